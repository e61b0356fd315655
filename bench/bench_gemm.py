"""W8A8 GEMM sweep: cutlass_w8a8 against cuBLAS bf16, torch._int_mm and torch._scaled_mm, on Llama-3 linears.

For every (shape, M) point, on the current CUDA device, in one process:

- ``bf16``: ``torch.matmul(x, w.t())``, x ``(M, K)`` and w ``(N, K)`` bfloat16 (cuBLAS).
- ``int_mm_scaled``: ``torch._int_mm(a, w.t())`` then ``(acc.float() * scale_a * scale_b).to(bf16)``,
  scale_a ``(M, 1)`` and scale_b ``(1, N)`` float32. torch refuses M <= 16; the error is recorded.
- ``torch_fp8_rowwise``: ``torch._scaled_mm`` on float8_e4m3fn with row-wise scales, bf16 out.
- ``ours_int8`` / ``ours_fp8``: ``cutlass_w8a8.scaled_mm(a, w.t(), scale_a (M, 1), scale_b (N,), bf16)``.
- ``ours_fp8_accurate``: ``ours_fp8`` with ``fp8_fast_accum=False`` (the accurate row-wise fp8 rows, promoted into
  float32 every 128 of K; the default is ``cutlass_w8a8/ops/_limits.py`` ``FP8_FAST_ACCUM``), with ``--fp8`` and
  ``--fp8-accurate`` (default on); reported as TOPS, x fp8-torch and x ours_fp8 (the cost of accuracy), with issue
  37's two targets for it (speed against torch's row-wise ``_scaled_mm`` at M >= 128, error against float64).
- ``linear_bf16`` / ``linear_w8a8``: ``nn.Linear(K, N, bias=False)`` in bf16 and its
  ``W8A8Linear.from_float`` (per-token int8 quantization of x plus the GEMM) on x.
- ``quant_int8``: that quantization alone.
- ``ours_int8_nopdl`` / ``linear_w8a8_nopdl``: ``ours_int8`` and ``linear_w8a8`` captured with programmatic
  dependent launch off (``cutlass_w8a8.set_pdl(False)``), to show what PDL is worth; the other rows use
  the default (on).
- ``linear_w8a8_fp8``: ``W8A8Linear.from_float`` of the same linear with ``W8A8Config(dtype=float8_e4m3fn)``
  (per-token fp8 quantization of x plus our fp8 GEMM), with ``--fp8``.
- ``ours_block`` / ``torch_block`` / ``linear_w8a8_block`` (and at M <= 16 the kernel family the dispatch does
  not pick): block-scaled fp8, 1x128 activation groups x 128x128 weight blocks, ours against torch's blockwise
  ``F.scaled_mm`` (bench/_gemm_block.py), with ``--fp8`` and ``--block-columns`` (default on).
- torchao peers, with ``--torchao`` (default: on when ``import torchao`` works): a copy of the bf16
  ``nn.Linear`` quantized by ``torchao.quantization.quantize_`` with ``Int8WeightOnlyConfig()``
  (``torchao_int8wo``), ``Int8DynamicActivationInt8WeightConfig()`` (``torchao_int8dq``) and, with ``--fp8`` on
  compute capability >= 8.9, ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
  (``torchao_fp8row``), each called through ``torch.compile`` (default mode, ``fullgraph=True``; without
  it only where dynamo reports a graph break). Compiled on the first call of a point, outside any capture,
  then warmed up, captured and timed like every other method; dynamo's automatic dynamic shapes compile each
  config twice per shape (M = the first value, then M dynamic), and its caches are reset between shapes. A
  config that fails to construct, or fails at every M of the first shape, is printed once and left out.

Timing (cutlass_w8a8.testing.timers.bench_gpu_time): CUDA-graph replay of R calls over rotating copies of the
inputs that together exceed twice the L2, so each call starts with a cold L2; median replay time / R. The
methods of a point are all captured first and their timed replays interleaved (see `time_methods`).
Before the timings of a point, ours is checked against a bf16 GEMM of the dequantized operands, and the
quantized linears (ours and torchao's) against the bf16 ``nn.Linear``.

fp8 accuracy (reported, every point): each fp8 GEMM path (CUTLASS row-wise, fast and accurate, decode GEMM, block,
torch's) against a float64 GEMM of the dequantized operands (bench/_gemm_accuracy.fp8_path_errors).

Writes ``gemm_<device>.json`` (raw numbers), ``gemm_<device>.md`` (tables) and ``gemm_<device>.png``
(speedup over bf16 and TOPS against M) to ``--out``.

``--block``: only the block-scaled fp8 comparison (issue 26), on the DeepSeek-V3 and Qwen3 shapes
(`cutlass_w8a8.testing.shapes.BLOCK_SHAPES`): ours block, torch blockwise, our and torch's row-wise fp8, bf16, the
row-wise and block fp8 ``W8A8Linear``, our accurate row-wise fp8 (unless ``--no-fp8-accurate``), and the read rate
measured in the same run; writes
``gemm_block_<device>.{json,md,png}``.

Examples::

    python bench/bench_gemm.py                       # full sweep
    python bench/bench_gemm.py --quick --shapes 8b   # Llama-3-8B shapes, 6 values of M
    python bench/bench_gemm.py --m 1,128,4096 --no-fp8
    python bench/bench_gemm.py --m 128,256,512,1024,2048,4096,8192 --no-torchao --no-pdl-ab --no-block-columns
                                                        # issue 37's row-wise fp8 targets (accurate vs torch)
    python bench/bench_gemm.py --quick --no-torchao     # without the torchao columns
    python bench/bench_gemm.py --block                  # block fp8 vs torch blockwise, DeepSeek-V3 + Qwen3 shapes
    python bench/bench_gemm.py --block --shapes dsv3 --quick
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch

from cutlass_w8a8.ops._limits import FP8_FAST_ACCUM
from cutlass_w8a8.testing.cli import chosen_shapes, int_list
from cutlass_w8a8.testing.report import provenance, publish, require_cuda_extension, run_checked
from cutlass_w8a8.testing.shapes import BLOCK_SHAPES, SHAPES

# bench/ is on sys.path (python bench/bench_gemm.py): the methods, the accuracy guard, the torchao peers and
# the reports live in bench/_gemm_*.py.
from _gemm_accuracy import (ACCURACY_COLS, ACCURACY_ROWS, FP8_LINEAR_REL_TOL, GEMM_REL_TOL, LINEAR_REL_TOL,
                            AccuracyError, check_accuracy, fp8_path_errors, rel_fro_error)
from _gemm_block import (BLOCK_MODE_METHODS, BLOCK_OPTIONAL, accuracy_paths, block_linear, block_methods,
                         block_operands, block_sections, block_targets, block_weight_scales, derive_block, plot_block,
                         render_block_markdown)
from _gemm_methods import OPTIONAL_METHODS, Weights, build_methods, make_activations, make_weights, short_error
from _gemm_report import fp8_accurate_targets, plot_results, render_markdown
from _gemm_torchao import TorchaoPeers, check_torchao, make_torchao_peers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_MS = (1, 16, 64, 256, 1024, 4096)


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark cutlass_w8a8 W8A8 GEMMs against cuBLAS bf16, torch._int_mm and "
                    "torch._scaled_mm on Llama-3-8B/70B linear shapes (cold-L2 CUDA-graph timing).")
    ms = parser.add_mutually_exclusive_group()
    ms.add_argument("--m", type=int_list(), default=None, metavar="LIST",
                    help=f"comma-separated M values (default: {','.join(map(str, DEFAULT_MS))})")
    ms.add_argument("--quick", action="store_true", help=f"M in {{{','.join(map(str, QUICK_MS))}}}")
    parser.add_argument("--shapes", default=None, metavar="LIST",
                        help="comma-separated substrings; keep the shapes whose name contains one "
                             f"(names: {', '.join(s[0] for s in SHAPES)}; with --block: "
                             f"{', '.join(s[0] for s in BLOCK_SHAPES)})")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                        help="also time cutlass_w8a8 with float8_e4m3fn operands (default: on)")
    parser.add_argument("--fp8-accurate", action=argparse.BooleanOptionalAction, default=True,
                        help="with --fp8, also time scaled_mm with fp8_fast_accum=False (accurate row-wise fp8, issue "
                             "37's targets; one more timed method among 12 to 19 per point, about 5-8%% more time; default: on)")
    parser.add_argument("--block", action="store_true",
                        help="only the block-scaled fp8 comparison (ours vs torch blockwise F.scaled_mm, row-wise "
                             "fp8, bf16) on the DeepSeek-V3 and Qwen3 shapes; writes gemm_block_<device>.*")
    parser.add_argument("--block-columns", action=argparse.BooleanOptionalAction, default=True,
                        help="in the full sweep, also time block-scaled fp8 (ours, torch blockwise, the block "
                             "W8A8Linear) with --fp8 (default: on)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for gemm_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--replays", type=int, default=25, help="timed CUDA-graph replays per measurement")
    parser.add_argument("--replay-ms", type=float, default=1.0,
                        help="target duration of one replay in ms; sets the calls per replay")
    parser.add_argument("--rotate-gb", type=float, default=4.0,
                        help="memory cap in GiB for the rotating input copies of one measurement")
    parser.add_argument("--peak-tops", type=float, default=None,
                        help="dense int8/fp8 peak in TOPS for %%peak (default: from the device name)")
    parser.add_argument("--seed", type=int, default=0, help="torch random seed")
    parser.add_argument("--pdl-ab", action=argparse.BooleanOptionalAction, default=True,
                        help="also time ours and W8A8Linear with PDL off, on sm90 (default: on)")
    parser.add_argument("--torchao", action=argparse.BooleanOptionalAction, default=None,
                        help="also time torchao's int8 weight-only, int8 dynamic and fp8 row-wise linears under "
                             "torch.compile (default: on when torchao imports)")
    args = parser.parse_args(argv)
    if args.replays < 1:
        parser.error("--replays must be >= 1")
    args.m_values = sorted(set(args.m or (QUICK_MS if args.quick else DEFAULT_MS)))
    if args.block and not args.fp8:
        parser.error("--block needs fp8 (drop --no-fp8)")
    table = BLOCK_SHAPES if args.block else SHAPES
    args.shape_list = chosen_shapes(parser, args.shapes, table)
    if args.block and args.torchao:
        parser.error("--block times no torchao peers (drop --torchao)")
    if args.block:
        args.torchao = False
    return args




# ----------------------------------------------------------------------------------------------------
# the sweep


def time_methods(methods: dict, errors: dict[str, str], bu: Any, l2_bytes: int,
                 args: argparse.Namespace, optional: frozenset = OPTIONAL_METHODS | BLOCK_OPTIONAL
                 ) -> tuple[dict[str, float], dict[str, dict]]:
    """Time every method not already in ``errors``; ``(ms per call by method, timing details by method)``.

    All methods of the point are captured first and their timed replays interleaved
    (`bench_utils.bench_gpu_time_interleaved`), so every method runs under the same clocks. Timing them one
    after the other made the same kernel differ by up to 25% at large M on an H200, depending on its place
    in the sequence (2026-11-21: ``ours_int8`` against ``ours_int8_nopdl``, identical launches at M > 16).
    A method of ``optional`` that fails is recorded in ``errors``; any other failure raises.
    """
    max_bytes = int(args.rotate_gb * 2**30)
    cases = {}
    for name, (fn, fn_args) in methods.items():
        if name in errors:
            continue
        try:
            fn(*fn_args)  # first call: torch's unsupported shapes fail here, not inside a capture
        except Exception as exc:  # noqa: BLE001
            if name not in optional:
                raise
            errors[name] = short_error(exc)
            continue
        try:
            cases[name] = (fn, bu.rotating_arg_sets(fn_args, l2_bytes, max_bytes))
        except Exception as exc:  # noqa: BLE001 (e.g. a module that cannot be deep-copied)
            if name not in optional:
                raise
            errors[name] = short_error(exc)

    def on_error(name: str, exc: BaseException) -> None:
        if name not in optional:
            raise exc
        errors[name] = short_error(exc)

    timings = bu.bench_gpu_time_interleaved(cases, replay_ms=args.replay_ms, replays=args.replays,
                                            on_error=on_error)
    cases.clear()
    times = {name: t.median_ms for name, t in timings.items()}
    details = {name: {"calls_per_replay": t.calls_per_replay, "copies": t.copies, "min_ms": t.min_ms,
                      "max_ms": t.max_ms} for name, t in timings.items()}
    return times, details


def derive(m: int, n: int, k: int, times: dict[str, float], copy_gbps: float,
           peak_tops: Optional[float], read_gbps: Optional[float] = None) -> dict[str, Any]:
    """Derived numbers of one point: times in us, TOPS (1e12 ops/s, 2*M*N*K ops), weight GB/s (1e9 B/s,
    N*K bytes per call), and speedups (baseline time / our time). Missing inputs give None.

    ``quant_visible_share`` is the part of the ``W8A8Linear`` forward that the GEMM alone does not account
    for, ``1 - t(ours_int8) / t(linear_w8a8)``: what the quantization adds once its launch overlaps the GEMM's
    (``quant_share_of_linear_w8a8`` is the quantization kernel's own time over the forward's)."""

    def ratio(num: str, den: str) -> Optional[float]:
        return times[num] / times[den] if num in times and den in times else None

    def tops(name: str) -> Optional[float]:
        return 2 * m * n * k / (times[name] * 1e-3) / 1e12 if name in times else None

    ours_tops = tops("ours_int8")
    # quantization traffic: read x (bf16), write q (int8) and one float32 scale per token
    quant_gbps = (3 * m * k + 4 * m) / (times["quant_int8"] * 1e-3) / 1e9 if "quant_int8" in times else None
    weight_gbps = n * k / (times["ours_int8"] * 1e-3) / 1e9 if "ours_int8" in times else None
    return {
        "time_us": {name: ms * 1e3 for name, ms in times.items()},
        "ours_tops": ours_tops,
        "ours_pct_peak": 100 * ours_tops / peak_tops if ours_tops is not None and peak_tops else None,
        "ours_weight_GBps": weight_gbps,
        "ours_weight_GBps_over_copy": weight_gbps / copy_gbps if weight_gbps is not None else None,
        "ours_weight_GBps_over_read": weight_gbps / read_gbps if weight_gbps is not None and read_gbps else None,
        "ours_x_bf16": ratio("bf16", "ours_int8"),
        "ours_x_torch_fp8": ratio("torch_fp8_rowwise", "ours_int8"),
        "ours_x_int_mm": ratio("int_mm_scaled", "ours_int8"),
        "linear_w8a8_x_bf16": ratio("linear_bf16", "linear_w8a8"),
        "quant_GBps": quant_gbps,
        "quant_GBps_over_copy": quant_gbps / copy_gbps if quant_gbps is not None else None,
        "quant_share_of_linear_w8a8": ratio("quant_int8", "linear_w8a8"),
        "quant_visible_share": (1 - times["ours_int8"] / times["linear_w8a8"]
                                if "ours_int8" in times and "linear_w8a8" in times else None),
        "pdl_gain_ours_int8": ratio("ours_int8_nopdl", "ours_int8"),
        "pdl_gain_linear_w8a8": ratio("linear_w8a8_nopdl", "linear_w8a8"),
        "ours_fp8_tops": tops("ours_fp8"),
        "ours_fp8_x_bf16": ratio("bf16", "ours_fp8"),
        "ours_fp8_x_torch_fp8": ratio("torch_fp8_rowwise", "ours_fp8"),
        # accurate row-wise fp8 (fp8_fast_accum=False): against torch's row-wise _scaled_mm (issue 37: >= 1.0 at
        # M >= 128) and against our fast-accumulation fp8 (< 1: what accuracy costs)
        "ours_fp8_accurate_tops": tops("ours_fp8_accurate"),
        "ours_fp8_accurate_x_torch_fp8": ratio("torch_fp8_rowwise", "ours_fp8_accurate"),
        "ours_fp8_accurate_x_ours_fp8": ratio("ours_fp8", "ours_fp8_accurate"),
        "linear_w8a8_fp8_x_bf16": ratio("linear_bf16", "linear_w8a8_fp8"),
        # torchao peers: their time / our W8A8Linear forward's (quantization included), > 1: ours is faster
        "linear_w8a8_x_torchao_int8wo": ratio("torchao_int8wo", "linear_w8a8"),
        "linear_w8a8_x_torchao_int8dq": ratio("torchao_int8dq", "linear_w8a8"),
        "linear_w8a8_x_torchao_fp8row": ratio("torchao_fp8row", "linear_w8a8"),
        "linear_w8a8_fp8_x_torchao_fp8row": ratio("torchao_fp8row", "linear_w8a8_fp8"),
    }


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the sweep runs without it
        return None
    # disable=None: no bar when stderr is not a terminal (a log file would get one line of carriage returns)
    return tqdm(total=total, unit="pt", dynamic_ncols=True, disable=None)


def _results_head(name: str, args: argparse.Namespace, cw: Any, rates: tuple[int, float, float],
                  lead: Optional[dict] = None, **after_pdl: Any) -> dict[str, Any]:
    """The head of a results dict, in its key order: `provenance` of device ``name``, ``lead``, ``rates`` (the L2
    size in bytes, the copy and read rates in GB/s), ``pdl``, ``after_pdl``, then ``timing`` (the method and
    ``args``' knobs)."""
    return {
        **provenance(name, REPO_ROOT),
        **(lead or {}),
        "l2_bytes": rates[0],
        "copy_GBps": rates[1],
        "read_GBps": rates[2],
        "pdl": bool(cw.pdl_enabled()),
        **after_pdl,
        "timing": {"method": "CUDA-graph replay over rotating input copies (> 2x L2), median replay / calls",
                   "replays": args.replays, "replay_ms": args.replay_ms, "rotate_gb": args.rotate_gb,
                   "order": "the methods of a point captured first, their timed replays interleaved"},
    }


def run_sweep(args: argparse.Namespace, cw: Any, bu: Any, peers: Optional[TorchaoPeers] = None,
              torchao_note: Optional[str] = None) -> dict[str, Any]:
    """Measure every (shape, M) point; returns the results dict that `main` writes.

    ``peers``: the torchao columns (None: none, ``torchao_note`` says why)."""
    name = torch.cuda.get_device_name()
    peak = args.peak_tops if args.peak_tops is not None else bu.dense_peak_tops(name)
    rates = l2_bytes, copy_gbps, read_gbps = bu.l2_cache_bytes(), bu.copy_bandwidth_gbps(), bu.read_bandwidth_gbps()
    results = {
        **_results_head(name, args, cw, rates, peak_tops=peak),
        "tolerances": {"gemm_rel_fro": GEMM_REL_TOL, "linear_rel_fro": LINEAR_REL_TOL},
        "fp8": args.fp8,
        "fp8_accurate": bool(args.fp8 and args.fp8_accurate),
        "fp8_fast_accum_default": FP8_FAST_ACCUM,
        "torchao": {"enabled": False, "reason": torchao_note},
        "block_columns": bool(args.fp8 and args.block_columns),
        "decode_gemm_max_m": cw._ext.decode_gemm_max_m(),
        "accuracy_corner": f"{ACCURACY_ROWS} x {ACCURACY_COLS}",
        "m_values": args.m_values,
        "shapes": [{"name": s, "N": n, "K": k} for s, n, k in args.shape_list],
        "points": [],
    }
    bar = _progress(len(args.shape_list) * len(args.m_values))
    try:
        fp8_config = cw.W8A8Config(dtype=torch.float8_e4m3fn) if args.fp8 else None
        for shape, n, k in args.shape_list:
            wts = make_weights(n, k, cw.W8A8Linear, fp8_config)
            if results["block_columns"]:
                add_block_weights(wts, n, k, cw)
            if peers is not None:
                wts.torchao = peers.quantize(wts.linear)
            for m in args.m_values:
                if bar is not None:
                    bar.set_postfix_str(f"{shape} M={m}")
                results["points"].append(measure_point(shape, m, n, k, wts, args, cw, bu, l2_bytes, copy_gbps, peak,
                                                      read_gbps, peers))
                if bar is not None:
                    bar.update()
            if peers is not None:
                peers.end_shape(shape)
            del wts
            torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
        if peers is not None:
            results["torchao"] = peers.summary()
    if results["block_columns"]:
        finish_block(results, bu, read_gbps, copy_gbps)
    if results["fp8_accurate"]:
        results["fp8_accurate_targets"] = fp8_accurate_targets(results["points"])
    return results


def add_block_weights(wts: Weights, n: int, k: int, cw: Any) -> None:
    """Give ``wts`` block-scaled fp8 operands: random ``(ceil(N/128), K/128)`` scales for ``wts.w_fp8`` (and torch's
    layout of them) and the block-scaled ``W8A8Linear`` of ``wts.linear`` (or why it could not be built)."""
    wts.scale_b_block, wts.scale_b_block_torch = block_weight_scales(n, k)
    wts.qlinear_block, wts.qlinear_block_error = block_linear(wts.linear, cw)


def check_fp8_guard(methods: dict, errors: dict[str, str], accuracy: dict, where: str) -> dict[str, float]:
    """The accuracy guard of the fp8 methods that `check_accuracy` does not cover: ``ours_fp8``,
    ``ours_fp8_accurate`` and ``ours_block`` (as dispatched) against float64 (`GEMM_REL_TOL`), and the fp8 linears of ``methods`` not yet checked
    (``linear_w8a8_block``; ``linear_w8a8_fp8`` in ``--block`` mode) against ``linear_bf16``
    (`FP8_LINEAR_REL_TOL`). Raises AccuracyError past a bound; a linear that fails is recorded in ``errors``
    and dropped from ``methods``. Returns the linears' relative errors."""
    for name in ("ours_fp8", "ours_fp8_accurate", "ours_block"):
        err = accuracy.get(name, {}).get("rel_fro")
        if err is not None and not err < GEMM_REL_TOL:
            raise AccuracyError(f"{where}: {name} relative Frobenius error {err:.3g} against float64 is not below "
                                f"{GEMM_REL_TOL:g}")
    rel: dict[str, float] = {}
    names = [n for n in ("linear_w8a8_fp8", "linear_w8a8_block") if n in methods]
    if not names:
        return rel
    ref_fn, ref_args = methods.get("linear_bf16") or (None, None)
    ref = ref_fn(*ref_args)
    for name in names:
        fn, args = methods[name]
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 (an optional layer that does not run is a result)
            errors[name] = short_error(exc)
            del methods[name]
            continue
        rel[name] = rel_fro_error(out, ref)
        if not rel[name] < FP8_LINEAR_REL_TOL:  # also catches NaN
            raise AccuracyError(f"{where}: {name} relative Frobenius error {rel[name]:.3g} against linear_bf16 is "
                                f"not below {FP8_LINEAR_REL_TOL:g}")
    return rel


def finish_block(results: dict[str, Any], bu: Any, read_start: float, copy_gbps: float) -> None:
    """After the sweep: the read rate measured again (``results["read_GBps_end"]``; the block weight-stream
    fraction uses the higher of the two, ``block_read_GBps``), each point's block numbers (`derive_block`) and the
    issue-26 targets (``results["block_targets"]``)."""
    read_end = bu.read_bandwidth_gbps()
    results["read_GBps_end"] = read_end
    results["block_read_GBps"] = max(read_start, read_end)
    for p in results["points"]:
        if any(name in p["time_ms"] for name in ("ours_block", "torch_block")):
            p["block"] = derive_block(p["M"], p["N"], p["K"], p["time_ms"], results["block_read_GBps"], copy_gbps)
    results["block_targets"] = block_targets(results["points"], bu.geomean)


def measure_point(shape: str, m: int, n: int, k: int, wts: Weights, args: argparse.Namespace, cw: Any, bu: Any,
                  l2_bytes: int, copy_gbps: float, peak: Optional[float],
                  read_gbps: Optional[float] = None, peers: Optional[TorchaoPeers] = None) -> dict[str, Any]:
    """Check and time one (shape, M) point; times in ms per call."""
    act = make_activations(m, k)
    set_pdl = cw.set_pdl if args.pdl_ab and torch.cuda.get_device_capability() == (9, 0) else None
    methods = build_methods(cw.scaled_mm, wts, act, args.fp8, set_pdl, args.fp8_accurate)
    errors: dict[str, str] = {}
    if args.fp8 and wts.qlinear_fp8_error is not None:
        errors["linear_w8a8_fp8"] = wts.qlinear_fp8_error
    blk = None
    if args.fp8 and wts.scale_b_block is not None:
        blk = block_operands(m, k, wts.scale_b_block, wts.scale_b_block_torch)
        methods.update(block_methods(cw, wts.w_fp8, act.a_fp8, blk, act.x_bf16, wts.qlinear_block,
                                     cw._ext.decode_gemm_max_m()))
        if wts.qlinear_block_error is not None:
            errors["linear_w8a8_block"] = wts.qlinear_block_error
    if peers is not None:
        methods.update(peers.methods(wts.torchao, act.x_bf16))
    where = f"{shape} M={m}"
    rel = check_accuracy(methods, errors, where)
    accuracy: dict = {}
    if args.fp8:
        accuracy = fp8_path_errors(accuracy_paths(cw, act.a_fp8, wts.w_fp8, act.scale_a, wts.scale_b, blk,
                                                  args.fp8_accurate), errors)
        # linear_w8a8_fp8 was checked by check_accuracy; a method that failed here is in `errors`, which
        # time_methods skips
        rel.update(check_fp8_guard({name: v for name, v in methods.items() if name != "linear_w8a8_fp8"}, errors,
                                   accuracy, where))
    if peers is not None:
        rel.update(check_torchao(methods, errors, where, peers))
    times, details = time_methods(methods, errors, bu, l2_bytes, args)
    del methods, act, blk
    torch.cuda.empty_cache()
    return {"shape": shape, "N": n, "K": k, "M": m, "time_ms": times, "errors": errors, "rel_err": rel,
            "accuracy": accuracy, "timing": details, "derived": derive(m, n, k, times, copy_gbps, peak, read_gbps)}


def measure_block_point(shape: str, m: int, n: int, k: int, wts: Weights, args: argparse.Namespace, cw: Any,
                        bu: Any, l2_bytes: int, decode_max_m: int) -> dict[str, Any]:
    """``--block``: check and time one (shape, M) point of the block comparison (`BLOCK_MODE_METHODS`); times in ms
    per call, the fp8 paths' errors against float64 under ``accuracy``."""
    act = make_activations(m, k)
    blk = block_operands(m, k, wts.scale_b_block, wts.scale_b_block_torch)
    base = build_methods(cw.scaled_mm, wts, act, True, None, args.fp8_accurate)
    methods = {name: base[name] for name in BLOCK_MODE_METHODS if name in base}
    methods.update(block_methods(cw, wts.w_fp8, act.a_fp8, blk, act.x_bf16, wts.qlinear_block, decode_max_m))
    errors: dict[str, str] = {}
    for name, why in (("linear_w8a8_fp8", wts.qlinear_fp8_error), ("linear_w8a8_block", wts.qlinear_block_error)):
        if why is not None:
            errors[name] = why
    where = f"{shape} M={m}"
    accuracy = fp8_path_errors(accuracy_paths(cw, act.a_fp8, wts.w_fp8, act.scale_a, wts.scale_b, blk,
                                              args.fp8_accurate), errors)
    rel = check_fp8_guard({**methods, "linear_bf16": base["linear_bf16"]}, errors, accuracy, where)
    times, details = time_methods(methods, errors, bu, l2_bytes, args)
    del methods, base, act, blk
    torch.cuda.empty_cache()
    return {"shape": shape, "N": n, "K": k, "M": m, "time_ms": times, "errors": errors, "rel_err": rel,
            "accuracy": accuracy, "timing": details}


def run_block_sweep(args: argparse.Namespace, cw: Any, bu: Any) -> dict[str, Any]:
    """``--block``: measure every (shape, M) point of the block comparison; the results dict that `main` writes."""
    rates = l2_bytes, copy_gbps, read_gbps = bu.l2_cache_bytes(), bu.copy_bandwidth_gbps(), bu.read_bandwidth_gbps()
    decode_max_m = cw._ext.decode_gemm_max_m()
    results = {
        **_results_head(torch.cuda.get_device_name(), args, cw, rates, {"mode": "block"},
                        decode_gemm_max_m=decode_max_m),
        "tolerances": {"gemm_rel_fro_vs_fp64": GEMM_REL_TOL, "fp8_linear_rel_fro": FP8_LINEAR_REL_TOL},
        "accuracy_corner": f"{ACCURACY_ROWS} x {ACCURACY_COLS}",
        "methods": [name for name in BLOCK_MODE_METHODS if args.fp8_accurate or name != "ours_fp8_accurate"],
        "m_values": args.m_values,
        "shapes": [{"name": s, "N": n, "K": k} for s, n, k in args.shape_list],
        "points": [],
    }
    bar = _progress(len(args.shape_list) * len(args.m_values))
    try:
        fp8_config = cw.W8A8Config(dtype=torch.float8_e4m3fn)
        for shape, n, k in args.shape_list:
            wts = make_weights(n, k, cw.W8A8Linear, fp8_config)
            add_block_weights(wts, n, k, cw)
            for m in args.m_values:
                if bar is not None:
                    bar.set_postfix_str(f"{shape} M={m}")
                results["points"].append(measure_block_point(shape, m, n, k, wts, args, cw, bu, l2_bytes,
                                                             decode_max_m))
                if bar is not None:
                    bar.update()
            del wts
            torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
    finish_block(results, bu, read_gbps, copy_gbps)
    return results


# ----------------------------------------------------------------------------------------------------
# main


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_gemm.py")
    from cutlass_w8a8.testing import timers as bu
    torch.manual_seed(args.seed)
    if args.block:
        with torch.no_grad():
            results = run_checked("bench_gemm.py --block", run_block_sweep, args, cw, bu)
        publish(results, render_block_markdown(results, bu.geomean), args.out, "gemm_block", plot_block)
        return 0
    peers, torchao_note = make_torchao_peers(args)
    with torch.no_grad():
        results = run_checked("bench_gemm.py", run_sweep, args, cw, bu, peers, torchao_note)
    report = render_markdown(results, bu.geomean) + "".join(line + "\n" for line in block_sections(results, bu.geomean))
    publish(results, report, args.out, "gemm", plot_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
