"""Decode GEMMs (M <= 16) at the memory limit: cw.scaled_mm against cw.scaled_mm_decode and cw.linear_decode.

For every Llama-3 8B/70B linear shape (cutlass_w8a8.testing.shapes.SHAPES, as bench/bench_gemm.py) and M in {1, 2, 4, 8, 16}, on the current
CUDA device, int8 with per-token x per-channel scales and bf16 out:

- ``scaled_mm``: ``cw.scaled_mm(a, w.t(), scale_a, scale_b)`` on the CUTLASS sm90 kernels (the decode bound set
  to 0 while it is captured: ``cutlass_w8a8._ext.set_decode_gemm_max_m``).
- ``decode``: ``cw.scaled_mm_decode`` on the same operands (csrc/gemm/decode/scaled_mm_decode.cu).
- ``dispatched``: ``cw.scaled_mm`` as it dispatches (the decode GEMM at M <= ``decode_gemm_max_m()``, else
  CUTLASS): what a decode step runs.
- ``quant_scaled_mm``: ``quantize_per_token(x)`` then the CUTLASS ``scaled_mm``.
- ``w8a8_linear``: the ``W8A8Linear`` forward op (quantization, then the dispatched GEMM).
- ``quant_decode``: ``quantize_per_token(x)`` then ``scaled_mm_decode``.
- ``linear_decode``: ``cw.linear_decode(x, w.t(), scale_b)``: the quantization inside the GEMM kernel.
- ``bf16_linear``: ``torch.nn.functional.linear(x, w_bf16)`` (cuBLAS), the unquantized reference.
- with ``--fp8``: ``scaled_mm_fp8``, ``decode_fp8`` and ``linear_decode_fp8`` on float8_e4m3fn operands.

Timing: cutlass_w8a8.testing.timers.bench_gpu_time_interleaved, CUDA-graph replays of R calls over rotating copies
of all inputs (weights included) that together exceed twice the L2, so every call streams its weight from HBM;
the methods of a point are captured first and their timed replays interleaved (same clocks). Before timing,
each point checks that ``decode`` equals ``scaled_mm`` bit for bit (int8 accumulates exactly in both) and
``linear_decode`` equals ``quant_decode`` bit for bit, and aborts otherwise.

Reported: time per call (us), weight streaming rate (N*K bytes of int8 / fp8 weight per call, 2*N*K for bf16,
in TB/s = 1e12 B/s) and its share of the datasheet HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s:
cutlass_w8a8.testing.timers.HBM_BANDWIDTH_GBPS), and ratios (> 1: the second-named method is faster):
``decode x scaled_mm`` = t(scaled_mm) / t(decode); ``fused x unfused`` = t(quant_decode) / t(linear_decode),
the crossover of csrc/gemm/decode/README.md; ``fused x W8A8Linear`` = t(quant_scaled_mm) / t(linear_decode).

Writes ``decode_gemm_<device>.json``, ``.md`` and ``.png`` to ``--out`` (default bench/results). The default run
(8 shapes x 5 M x 6 methods, about 25 timed 1 ms replays each) is estimated at under two minutes on an H100
(not yet measured).

Examples::

    python bench/bench_decode_gemm.py
    python bench/bench_decode_gemm.py --shapes 8b --m 1,16 --fp8
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import finish_sweep_args, int_list
from cutlass_w8a8.testing.physical import judge, mark, physical_check, verdict
from cutlass_w8a8.testing.report import (AccuracyError, markdown, publish, require_cuda_extension, run_checked,
                                         save_figure)
from cutlass_w8a8.testing.shapes import SHAPES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_MS = (1, 2, 4, 8, 16)
METHODS = ("scaled_mm", "decode", "dispatched", "quant_scaled_mm", "quant_decode", "w8a8_linear", "linear_decode",
           "bf16_linear")
FP8_METHODS = ("scaled_mm_fp8", "decode_fp8", "linear_decode_fp8")
# Bytes of weight each method streams per call, per N*K.
WEIGHT_BYTES_PER_ELEMENT = {name: 1 for name in METHODS + FP8_METHODS}
WEIGHT_BYTES_PER_ELEMENT["bf16_linear"] = 2



# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time cutlass_w8a8's decode GEMMs (M <= 16) against scaled_mm and "
                                                 "bf16 on the Llama-3 linear shapes (cold-L2 CUDA-graph timing).")
    parser.add_argument("--m", type=int_list(16), default=list(DEFAULT_MS), metavar="LIST",
                        help=f"comma-separated M values in [1, 16] (default: {','.join(map(str, DEFAULT_MS))})")
    parser.add_argument("--shapes", default=None, metavar="LIST",
                        help="comma-separated substrings; keep the shapes whose name contains one "
                             f"(names: {', '.join(s[0] for s in SHAPES)})")
    parser.add_argument("--fp8", action="store_true", help="also time the float8_e4m3fn methods")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for decode_gemm_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--replays", type=int, default=25, help="timed CUDA-graph replays per method and point")
    parser.add_argument("--replay-ms", type=float, default=1.0, help="target duration of one replay in ms")
    parser.add_argument("--rotate-gb", type=float, default=4.0,
                        help="memory cap in GiB for the rotating input copies of one method")
    parser.add_argument("--seed", type=int, default=0, help="torch random seed")
    return finish_sweep_args(parser, parser.parse_args(argv))


# ----------------------------------------------------------------------------------------------------
# the timed callables (module-level functions: bench_utils clones their tensor arguments per rotation)


class _cutlass_only:
    """scaled_mm's decode bound set to 0 while the block runs (at capture time inside a CUDA graph): the CUTLASS
    kernels serve every M, as before the decode GEMM joined scaled_mm's dispatch."""

    def __init__(self, cw):
        self.ext = cw._ext

    def __enter__(self):
        self.previous = self.ext.set_decode_gemm_max_m(0)

    def __exit__(self, *exc):
        self.ext.set_decode_gemm_max_m(self.previous)


def run_scaled_mm(cw, a, w, sa, sb):
    with _cutlass_only(cw):
        return cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)


def run_dispatched(cw, a, w, sa, sb):
    return cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)


def run_w8a8_linear(cw, x, w, sb, dtype):
    return torch.ops.cutlass_w8a8.w8a8_linear(x, w, sb, None, None, torch.bfloat16)


def run_decode(cw, a, w, sa, sb):
    return cw.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16)


def run_quant_scaled_mm(cw, x, w, sb, dtype):
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, dtype)
    with _cutlass_only(cw):
        return cw.scaled_mm(q, w.t(), s, sb, torch.bfloat16)


def run_quant_decode(cw, x, w, sb, dtype):
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, dtype)
    return cw.scaled_mm_decode(q, w.t(), s, sb, torch.bfloat16)


def run_linear_decode(cw, x, w, sb, dtype):
    return cw.linear_decode(x, w.t(), sb, None, dtype)


def run_bf16_linear(x, w):
    return torch.nn.functional.linear(x, w)


def build_methods(cw, n: int, k: int, m: int, fp8: bool) -> dict[str, tuple[Callable, tuple]]:
    """``name -> (fn, args)`` of one point, fresh random operands."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    w16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    sb = (torch.rand(n, device="cuda") + 0.5) * 1e-3
    a, sa = torch.ops.cutlass_w8a8.quantize_per_token(x, torch.int8)
    methods = {
        "scaled_mm": (run_scaled_mm, (cw, a, w8, sa, sb)),
        "decode": (run_decode, (cw, a, w8, sa, sb)),
        "dispatched": (run_dispatched, (cw, a, w8, sa, sb)),
        "w8a8_linear": (run_w8a8_linear, (cw, x, w8, sb, torch.int8)),
        "quant_scaled_mm": (run_quant_scaled_mm, (cw, x, w8, sb, torch.int8)),
        "quant_decode": (run_quant_decode, (cw, x, w8, sb, torch.int8)),
        "linear_decode": (run_linear_decode, (cw, x, w8, sb, torch.int8)),
        "bf16_linear": (run_bf16_linear, (x, w16)),
    }
    if fp8:
        wf = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").to(torch.float8_e4m3fn)
        af, saf = torch.ops.cutlass_w8a8.quantize_per_token(x, torch.float8_e4m3fn)
        methods["scaled_mm_fp8"] = (run_scaled_mm, (cw, af, wf, saf, sb))
        methods["decode_fp8"] = (run_decode, (cw, af, wf, saf, sb))
        methods["linear_decode_fp8"] = (run_linear_decode, (cw, x, wf, sb, torch.float8_e4m3fn))
    return methods


def check_point(methods: dict, where: str) -> None:
    """decode == scaled_mm (int8, bit for bit) and linear_decode == quant_decode (bit for bit)."""
    def out(name):
        fn, args = methods[name]
        return fn(*args)

    if not torch.equal(out("decode"), out("scaled_mm")):
        raise AccuracyError(f"{where}: scaled_mm_decode differs from scaled_mm (int8)")
    if not torch.equal(out("dispatched"), out("scaled_mm")):
        raise AccuracyError(f"{where}: the dispatched scaled_mm differs from the CUTLASS one (int8)")
    if not torch.equal(out("w8a8_linear"), out("quant_decode")):
        raise AccuracyError(f"{where}: w8a8_linear differs from quantize_per_token + scaled_mm (int8)")
    if not torch.equal(out("linear_decode"), out("quant_decode")):
        raise AccuracyError(f"{where}: linear_decode differs from quantize_per_token + scaled_mm_decode")
    if "decode_fp8" in methods:
        ref = out("scaled_mm_fp8").float()
        rel = ((out("decode_fp8").float() - ref).norm() / ref.norm()).item()
        if not rel < 1e-2:
            raise AccuracyError(f"{where}: fp8 scaled_mm_decode is {rel:.3g} (relative) away from scaled_mm")


# ----------------------------------------------------------------------------------------------------
# the sweep


def derive(m: int, n: int, k: int, times_ms: dict[str, float], hbm_gbps: Optional[float]) -> dict[str, Any]:
    """Times in us, weight TB/s and % of the datasheet HBM bandwidth per method, and the ratios."""
    def ratio(num: str, den: str) -> Optional[float]:
        return times_ms[num] / times_ms[den] if num in times_ms and den in times_ms else None

    tbps = {name: WEIGHT_BYTES_PER_ELEMENT[name] * n * k / (t * 1e-3) / 1e12 for name, t in times_ms.items()}
    return {
        "time_us": {name: t * 1e3 for name, t in times_ms.items()},
        "weight_TBps": tbps,
        "pct_hbm": {name: 100 * v * 1e3 / hbm_gbps for name, v in tbps.items()} if hbm_gbps else {},
        "decode_x_scaled_mm": ratio("scaled_mm", "decode"),
        "dispatched_x_scaled_mm": ratio("scaled_mm", "dispatched"),
        "w8a8_linear_x_quant_scaled_mm": ratio("quant_scaled_mm", "w8a8_linear"),
        "fused_x_unfused": ratio("quant_decode", "linear_decode"),
        "fused_x_w8a8linear": ratio("quant_scaled_mm", "linear_decode"),
        "quant_decode_x_quant_scaled_mm": ratio("quant_scaled_mm", "quant_decode"),
        "decode_x_bf16": ratio("bf16_linear", "decode"),
        "linear_decode_x_bf16": ratio("bf16_linear", "linear_decode"),
        "decode_fp8_x_scaled_mm_fp8": ratio("scaled_mm_fp8", "decode_fp8"),
        "fp8_fused_x_int8_fused": ratio("linear_decode", "linear_decode_fp8"),
    }


def measure_point(shape: str, m: int, n: int, k: int, args, cw, bu, l2_bytes: int,
                  hbm_gbps: Optional[float]) -> dict[str, Any]:
    methods = build_methods(cw, n, k, m, args.fp8)
    check_point(methods, f"{shape} M={m}")
    max_bytes = int(args.rotate_gb * 2**30)
    cases = {name: (fn, bu.rotating_arg_sets(fn_args, l2_bytes, max_bytes)) for name, (fn, fn_args) in methods.items()}
    errors: dict[str, str] = {}

    def on_error(name: str, exc: BaseException) -> None:
        errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]

    timings = bu.bench_gpu_time_interleaved(cases, replay_ms=args.replay_ms, replays=args.replays, on_error=on_error)
    del cases, methods
    torch.cuda.empty_cache()
    times = {name: t.median_ms for name, t in timings.items()}
    return {"shape": shape, "N": n, "K": k, "M": m, "time_ms": times, "errors": errors,
            "timing": {name: {"calls_per_replay": t.calls_per_replay, "copies": t.copies, "min_ms": t.min_ms,
                              "max_ms": t.max_ms} for name, t in timings.items()},
            "derived": derive(m, n, k, times, hbm_gbps)}


def run_sweep(args, cw, bu) -> dict[str, Any]:
    name = torch.cuda.get_device_name()
    l2_bytes = bu.l2_cache_bytes()
    hbm = bu.hbm_bandwidth_gbps(name)
    commit, dirty = bu.git_commit(REPO_ROOT)
    results = {
        "device": name,
        "device_slug": bu.device_slug(name),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "sm_count": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "git_commit": commit,
        "git_dirty": dirty,
        "l2_bytes": l2_bytes,
        "hbm_GBps_datasheet": hbm,
        "read_GBps": bu.read_bandwidth_gbps(),
        "pdl": bool(cw.pdl_enabled()),
        "decode_gemm_max_m": cw._ext.decode_gemm_max_m(),
        "timing": {"method": "CUDA-graph replay over rotating input copies (> 2x L2), median replay / calls",
                   "replays": args.replays, "replay_ms": args.replay_ms, "rotate_gb": args.rotate_gb,
                   "order": "the methods of a point captured first, their timed replays interleaved"},
        "fp8": args.fp8,
        "m_values": args.m_values,
        "shapes": [{"name": s, "N": n, "K": k} for s, n, k in args.shape_list],
        "points": [],
    }
    for shape, n, k in args.shape_list:
        for m in args.m_values:
            point = measure_point(shape, m, n, k, args, cw, bu, l2_bytes, hbm)
            results["points"].append(point)
            d = point["derived"]
            print(f"{shape:>15} M={m:>2}: scaled_mm {_fmt(d['time_us'].get('scaled_mm'), '.1f')} us, "
                  f"decode {_fmt(d['time_us'].get('decode'), '.1f')} us "
                  f"({_fmt(d['weight_TBps'].get('decode'), '.2f')} TB/s), "
                  f"linear_decode {_fmt(d['time_us'].get('linear_decode'), '.1f')} us", flush=True)
    return results


# ----------------------------------------------------------------------------------------------------
# report


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


TIME_COLUMNS = (("scaled_mm (CUTLASS)", "scaled_mm"), ("decode", "decode"), ("scaled_mm dispatched", "dispatched"),
                ("quant+CUTLASS", "quant_scaled_mm"), ("quant+decode", "quant_decode"),
                ("w8a8_linear", "w8a8_linear"), ("linear_decode", "linear_decode"), ("bf16", "bf16_linear"),
                ("fp8 scaled_mm", "scaled_mm_fp8"), ("fp8 decode", "decode_fp8"),
                ("fp8 linear_decode", "linear_decode_fp8"))
RATIO_COLUMNS = (("decode x scaled_mm", "decode_x_scaled_mm"), ("dispatched x CUTLASS", "dispatched_x_scaled_mm"),
                 ("w8a8_linear x quant+CUTLASS", "w8a8_linear_x_quant_scaled_mm"), ("fused x unfused", "fused_x_unfused"),
                 ("fused x W8A8Linear", "fused_x_w8a8linear"), ("decode x bf16", "decode_x_bf16"),
                 ("fp8 decode x fp8 scaled_mm", "decode_fp8_x_scaled_mm_fp8"))


def _present_times(points):
    return [c for c in TIME_COLUMNS if any(c[1] in p["derived"]["time_us"] for p in points)]


def _present_ratios(points):
    return [c for c in RATIO_COLUMNS if any(p["derived"].get(c[1]) is not None for p in points)]


def time_table(points: list[dict]) -> str:
    cols = _present_times(points)
    rows = ["| shape | M | " + " | ".join(f"{h} us" for h, _ in cols) + " |",
            "|:---|---:|" + "---:|" * len(cols)]
    for p in points:
        t = p["derived"]["time_us"]
        rows.append(f"| {p['shape']} | {p['M']} | " + " | ".join(_fmt(t.get(k), ".1f") for _, k in cols) + " |")
    return "\n".join(rows)


def bandwidth_table(points: list[dict], hbm: Optional[float]) -> str:
    cols = [c for c in _present_times(points) if c[1] not in ("quant_scaled_mm", "quant_decode", "w8a8_linear")]
    rows = ["| shape | M | " + " | ".join(f"{h} TB/s (%HBM)" for h, _ in cols) + " |",
            "|:---|---:|" + "---:|" * len(cols)]
    for p in points:
        d = p["derived"]
        # a stream above the datasheet HBM bandwidth is impossible (cold L2: the weights stream from HBM)
        cells = [mark(f"{_fmt(d['weight_TBps'].get(k), '.2f')} ({_fmt(d['pct_hbm'].get(k), '.0f')}%)",
                      physical_check(d["pct_hbm"].get(k), 100.0, "% of HBM")) if hbm else
                 _fmt(d["weight_TBps"].get(k), ".2f") for _, k in cols]
        rows.append(f"| {p['shape']} | {p['M']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ratio_table(points: list[dict], geomean: Callable) -> str:
    cols = _present_ratios(points)
    rows = ["| M | " + " | ".join(h for h, _ in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for m in sorted({p["M"] for p in points}):
        members = [p for p in points if p["M"] == m]
        cells = [_fmt(geomean([p["derived"][k] for p in members if p["derived"].get(k) is not None]), ".2f")
                 for _, k in cols]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def crossover_table(points: list[dict]) -> str:
    """linear_decode over quantize + scaled_mm_decode per shape (rows) and M (columns)."""
    ms = sorted({p["M"] for p in points})
    shapes = list(dict.fromkeys(p["shape"] for p in points))
    rows = ["| shape | " + " | ".join(f"M={m}" for m in ms) + " |", "|:---|" + "---:|" * len(ms)]
    for s in shapes:
        by_m = {p["M"]: p["derived"].get("fused_x_unfused") for p in points if p["shape"] == s}
        rows.append(f"| {s} | " + " | ".join(_fmt(by_m.get(m), ".2f") for m in ms) + " |")
    return "\n".join(rows)


def read_rate_target(points: list[dict], read_gbps: Optional[float]) -> str:
    """One line per M: the dispatched GEMM's weight rate over the measured read-only rate, worst shape first."""
    if not read_gbps:
        return "- no read-only rate measured"
    lines = []
    for m in sorted({p["M"] for p in points}):
        shares = sorted((p["derived"]["weight_TBps"]["dispatched"] * 1e3 / read_gbps, p["shape"]) for p in points
                        if p["M"] == m and p["derived"]["weight_TBps"].get("dispatched") is not None)
        if not shares:
            continue
        worst, shape = shares[0]
        # a weight stream above the read rate measured in the run (its stated peak) is a broken measurement
        checks = {s: physical_check(v, 1.0, f"{s} at {100 * v:.0f}% of the measured read rate") for v, s in shares}
        met, invalid = judge(worst >= 0.85, *checks.values())
        lines.append(f"- M = {m}: worst {shape} at {100 * worst:.0f}% of {read_gbps:.0f} GB/s "
                     f"({verdict(met, invalid)}); "
                     + ", ".join(mark(f"{s} {100 * v:.0f}%", checks[s]) for v, s in sorted(shares, key=lambda t: t[1])))
    return "\n".join(lines)


def render_markdown(results: dict[str, Any], geomean: Callable) -> str:
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    hbm = results.get("hbm_GBps_datasheet")
    points = results["points"]
    errors = [f"- `{name}` at {p['shape']} M={p['M']}: `{msg}`" for p in points for name, msg in p["errors"].items()]
    lines = [
        f"# Decode GEMMs (M <= 16): {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}; "
        f"{results.get('sm_count')} SMs, L2 {results['l2_bytes'] / 2**20:.0f} MiB",
        f"- HBM bandwidth: datasheet {_fmt(hbm, '.0f')} GB/s; measured read-only "
        f"{_fmt(results.get('read_GBps'), '.0f')} GB/s (a float32 max-reduction over 1 GiB)",
        f"- PDL: {'on' if results.get('pdl') else 'off'}. int8 (and, where listed, fp8) operands, per-token x "
        "per-channel scales, bf16 out. Cold-L2 CUDA-graph replays over rotating copies of all inputs (weights "
        f"included), median of {results['timing']['replays']} replays, the methods of a point interleaved.",
        "- scaled_mm (CUTLASS) = the CUTLASS kernels at every M; decode = `scaled_mm_decode`; scaled_mm dispatched = "
        f"`scaled_mm` as a decode step runs it (decode GEMM at M <= {results.get('decode_gemm_max_m', '?')}); "
        "w8a8_linear = the W8A8Linear forward (quantization + dispatched GEMM); quant+X = `quantize_per_token` then X; "
        "linear_decode = quantization inside the GEMM kernel; bf16 = `F.linear` on bf16 weights (2 bytes per "
        "weight in its TB/s).",
        "- Ratios (> 1: the first-named is faster): decode x scaled_mm = t(scaled_mm) / t(decode); fused x "
        "unfused = t(quant+decode) / t(linear_decode); fused x W8A8Linear = t(quant+scaled_mm) / t(linear_decode).",
        "",
        "## Times",
        "",
        time_table(points),
        "",
        "## Weight streaming rate",
        "",
        bandwidth_table(points, hbm),
        "",
        "## Target: every W8A8 GEMM of a decode step (scaled_mm as dispatched) at >= 85% of the read-only rate",
        "",
        read_rate_target(points, results.get("read_GBps")),
        "",
        "## Geomean ratios over the shapes, by M",
        "",
        ratio_table(points, geomean),
        "",
        "## Fused quantization: linear_decode over quantize_per_token + scaled_mm_decode (> 1: fused is faster)",
        "",
        crossover_table(points),
    ]
    return markdown(lines, ("## Methods that did not run", errors))


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: share of the datasheet HBM bandwidth against M, per shape: scaled_mm_decode (solid) and scaled_mm
    (dashed); linear_decode over quantize + scaled_mm_decode on the right."""
    try:
        import matplotlib
    except ImportError:
        print(f"bench_decode_gemm.py: matplotlib is not installed; no plot at {path}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_fused) = plt.subplots(1, 2, figsize=(13, 5))
    key = "pct_hbm" if results.get("hbm_GBps_datasheet") else "weight_TBps"
    for i, shape in enumerate(dict.fromkeys(p["shape"] for p in results["points"])):
        pts = sorted((p for p in results["points"] if p["shape"] == shape), key=lambda p: p["M"])
        color = f"C{i % 10}"
        for method, style in (("decode", "-"), ("scaled_mm", "--")):
            xy = [(p["M"], p["derived"][key].get(method)) for p in pts if p["derived"][key].get(method) is not None]
            if xy:
                ax_bw.plot(*zip(*xy), style, color=color, marker="o", markersize=3,
                           label=f"{shape} {method}" if method == "decode" else None)
        xy = [(p["M"], p["derived"]["fused_x_unfused"]) for p in pts if p["derived"]["fused_x_unfused"] is not None]
        if xy:
            ax_fused.plot(*zip(*xy), color=color, marker="o", markersize=3, label=shape)
    ax_bw.set_ylabel("% of datasheet HBM bandwidth" if key == "pct_hbm" else "weight TB/s")
    ax_bw.set_title("weight streaming: scaled_mm_decode (solid), scaled_mm (dashed)")
    ax_fused.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_fused.set_ylabel("t(quantize + scaled_mm_decode) / t(linear_decode)")
    ax_fused.set_title("fused quantization (> 1: linear_decode faster)")
    for ax in (ax_bw, ax_fused):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path, f"Decode GEMMs, {results['device']}, torch {results['torch_version']}")


# ----------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_decode_gemm.py")
    from cutlass_w8a8.testing import timers as bu
    if args.fp8 and torch.cuda.get_device_capability() < (8, 9):
        sys.exit("bench_decode_gemm.py: --fp8 needs compute capability 8.9 or newer")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        results = run_checked("bench_decode_gemm.py", run_sweep, args, cw, bu)
    publish(results, render_markdown(results, bu.geomean), args.out, "decode_gemm", plot_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
