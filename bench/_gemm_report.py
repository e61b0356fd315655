"""bench/bench_gemm.py's reports: the Markdown tables (per point, torchao peers, summary by M group, errors),
issue 37's targets for accurate row-wise fp8 (`fp8_accurate_targets`), `render_markdown` of a results dict, and
`plot_results` (speedup over bf16 and TOPS against M; needs matplotlib).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from _gemm_block import _target, targets_lines
from _gemm_methods import TORCHAO_METHODS
from cutlass_w8a8.testing.physical import mark, physical_check, share_check
from cutlass_w8a8.testing.report import markdown, save_figure

# Upper bounds (inclusive) of the M groups of the summary table: decode, mid-size batches, prefill.
M_GROUP_BOUNDS = (16, 512, None)

# Issue 37's targets for accurate row-wise fp8 (``ours_fp8_accurate``: scaled_mm with fp8_fast_accum=False), one run,
# H100 or H200: >= 1.0x torch's row-wise _scaled_mm at every M >= 128 on the GEMM shapes, and a relative Frobenius
# error against float64 (bf16 out) <= 2.0e-3 (the bf16 rounding alone costs about 1.6e-3 on these operands).
TARGET_ACCURATE_X_TORCH_MIN = 1.0
TARGET_ACCURATE_M = 128
TARGET_ACCURATE_REL = 2.0e-3
# the accuracy paths of accurate row-wise fp8 (bench/_gemm_block.accuracy_paths): as dispatched (the decode GEMM at
# M <= decode_gemm_max_m(), the accurate CUTLASS rows above) and the CUTLASS rows at every M
ACCURATE_ERROR_PATHS = ("ours_fp8_accurate", "cutlass_fp8_accurate")


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def point_table(points: list[dict]) -> str:
    """Markdown table, one row per (shape, M). A figure beyond its physical bound is marked INVALID
    (`cutlass_w8a8.testing.physical`): %peak above 100, a share outside [0, 1]."""
    rows = [("| M | shape | ours us | TOPS | %peak | weight GB/s | x bf16 | x fp8-torch | x int_mm | fp8 x fp8-torch "
             "| linear x bf16 | quant GB/s | quant share | quant visible | PDL gain | linear PDL gain "
             "| fp8 acc TOPS | fp8 acc x fp8-torch | fp8 acc x fp8 |"),
            "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        d = p["derived"]
        peak = mark(_fmt(d["ours_pct_peak"], ".1f"), physical_check(d["ours_pct_peak"], 100.0, "% of peak"))
        share = mark(_fmt(d["quant_share_of_linear_w8a8"], ".2f"),
                     share_check(d["quant_share_of_linear_w8a8"], "quant share"))
        visible = mark(_fmt(d.get("quant_visible_share"), ".2f"),
                       share_check(d.get("quant_visible_share"), "quant visible share"))
        rows.append(f"| {p['M']} | {p['shape']} | {_fmt(d['time_us'].get('ours_int8'), '.1f')} "
                    f"| {_fmt(d['ours_tops'], '.1f')} | {peak} "
                    f"| {_fmt(d['ours_weight_GBps'], '.0f')} | {_fmt(d['ours_x_bf16'], '.2f')} "
                    f"| {_fmt(d['ours_x_torch_fp8'], '.2f')} | {_fmt(d['ours_x_int_mm'], '.2f')} "
                    f"| {_fmt(d['ours_fp8_x_torch_fp8'], '.2f')} | {_fmt(d['linear_w8a8_x_bf16'], '.2f')} "
                    f"| {_fmt(d['quant_GBps'], '.0f')} | {share} "
                    f"| {visible} | {_fmt(d.get('pdl_gain_ours_int8'), '.2f')} "
                    f"| {_fmt(d.get('pdl_gain_linear_w8a8'), '.2f')} "
                    f"| {_fmt(d.get('ours_fp8_accurate_tops'), '.1f')} "
                    f"| {_fmt(d.get('ours_fp8_accurate_x_torch_fp8'), '.2f')} "
                    f"| {_fmt(d.get('ours_fp8_accurate_x_ours_fp8'), '.2f')} |")
    return "\n".join(rows)


def torchao_table(points: list[dict]) -> str:
    """Markdown table, one row per (shape, M): our W8A8Linear forwards and the torchao peers in us, and the
    peers' time over ours."""
    names = ("linear_w8a8", "linear_w8a8_fp8", *TORCHAO_METHODS)
    heads = ("linear us", "fp8 linear us", "ao int8wo us", "ao int8dq us", "ao fp8row us")
    columns = _present(points, TORCHAO_COLUMNS)
    rows = ["| M | shape | " + " | ".join(heads) + " | " + " | ".join(c for c, _ in columns) + " |",
            "|---:|:---|" + "---:|" * (len(heads) + len(columns))]
    for p in points:
        d = p["derived"]
        cells = [_fmt(d["time_us"].get(name), ".1f") for name in names]
        cells += [_fmt(d.get(key), ".2f") for _, key in columns]
        rows.append(f"| {p['M']} | {p['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def torchao_notes(results: dict[str, Any]) -> list[str]:
    """Header lines on the torchao columns: version, configs, compile mode, and what was left out."""
    info = results.get("torchao") or {}
    if not info.get("enabled"):
        return [f"- torchao columns: none ({info.get('reason') or 'not run'})"]
    lines = [f"- torchao {info['version']}: a copy of the bf16 `nn.Linear` quantized by `torchao.quantization."
             f"quantize_`, called through {info['compile']}. x ao <config> = the torchao module's time / our "
             "`W8A8Linear` forward's (quantization included; int8, or fp8 for `fp8 x ao fp8row`): > 1, ours is faster."]
    for name, c in info["configs"].items():
        state = f"left out: {c['left_out']}" if c.get("left_out") else f"fullgraph={c['fullgraph']}"
        lines.append(f"  - `{name}` ({c['label']}): `{c.get('config') or '?'}`; {state}")
    return lines


def m_groups(points: list[dict]) -> list[tuple[str, list[dict]]]:
    """Points split by `M_GROUP_BOUNDS`, each labelled with the range of M it holds, e.g. ``"1–16"``."""
    groups, lower = [], 0
    for upper in M_GROUP_BOUNDS:
        members = [p for p in points if p["M"] > lower and (upper is None or p["M"] <= upper)]
        if members:
            ms = sorted({p["M"] for p in members})
            groups.append((f"{ms[0]}–{ms[-1]}" if len(ms) > 1 else str(ms[0]), members))
        lower = upper if upper is not None else lower
    return groups


SUMMARY_COLUMNS = (("x bf16", "ours_x_bf16"), ("x fp8-torch", "ours_x_torch_fp8"), ("x int_mm", "ours_x_int_mm"),
                   ("fp8 x bf16", "ours_fp8_x_bf16"), ("fp8 x fp8-torch", "ours_fp8_x_torch_fp8"),
                   ("linear w8a8 x bf16", "linear_w8a8_x_bf16"), ("PDL gain", "pdl_gain_ours_int8"),
                   ("linear PDL gain", "pdl_gain_linear_w8a8"))
# Shown only where some point has them: accurate row-wise fp8, the fp8 W8A8Linear and the torchao peers (W8A8Linear
# over them).
OPTIONAL_SUMMARY_COLUMNS = (("fp8 acc x fp8-torch", "ours_fp8_accurate_x_torch_fp8"),
                            ("fp8 acc x fp8", "ours_fp8_accurate_x_ours_fp8"),
                            ("fp8 linear x bf16", "linear_w8a8_fp8_x_bf16"),
                            ("linear x ao int8wo", "linear_w8a8_x_torchao_int8wo"),
                            ("linear x ao int8dq", "linear_w8a8_x_torchao_int8dq"),
                            ("linear x ao fp8row", "linear_w8a8_x_torchao_fp8row"),
                            ("fp8 linear x ao fp8row", "linear_w8a8_fp8_x_torchao_fp8row"))
TORCHAO_COLUMNS = (("x ao int8wo", "linear_w8a8_x_torchao_int8wo"), ("x ao int8dq", "linear_w8a8_x_torchao_int8dq"),
                   ("x ao fp8row", "linear_w8a8_x_torchao_fp8row"),
                   ("fp8 x ao fp8row", "linear_w8a8_fp8_x_torchao_fp8row"))


def _present(points: list[dict], columns) -> tuple:
    return tuple(c for c in columns if any(p["derived"].get(c[1]) is not None for p in points))


def summary_table(points: list[dict], geomean: Callable) -> str:
    """Markdown table of geomean speedups per M group (a cell counts the points where both times exist)."""
    columns = SUMMARY_COLUMNS + _present(points, OPTIONAL_SUMMARY_COLUMNS)
    rows = ["| M | points | " + " | ".join(c for c, _ in columns) + " |",
            "|:---|---:|" + "---:|" * len(columns)]
    for label, members in m_groups(points):
        cells = [_fmt(geomean([p["derived"][key] for p in members if p["derived"].get(key) is not None]), ".2f")
                 for _, key in columns]
        rows.append(f"| {label} | {len(members)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def error_notes(points: list[dict]) -> str:
    """One line per method that failed somewhere: the values of M and the first message."""
    failed: dict[str, tuple[list[int], str]] = {}
    for p in points:
        for name, msg in p["errors"].items():
            ms, first = failed.setdefault(name, ([], msg))
            if p["M"] not in ms:
                ms.append(p["M"])
    return "\n".join(f"- `{name}` did not run at M in {{{', '.join(map(str, sorted(ms)))}}}: `{msg}`"
                     for name, (ms, msg) in failed.items())


def fp8_accurate_targets(points: list[dict]) -> list[dict]:
    """Issue 37's two targets for accurate row-wise fp8, over the points of a sweep (`bench_gemm.measure_point`'s
    dicts, with ``derived`` and ``accuracy``): the lowest ``ours_fp8_accurate_x_torch_fp8`` (torch's row-wise
    ``_scaled_mm`` time / ours accurate) over M >= `TARGET_ACCURATE_M`, against `TARGET_ACCURATE_X_TORCH_MIN`, and
    the highest relative Frobenius error against float64 of the `ACCURATE_ERROR_PATHS` at any M, against
    `TARGET_ACCURATE_REL`. Targets in bench/_gemm_block's form (``met`` None where no point has the number)."""
    big = [(p["derived"].get("ours_fp8_accurate_x_torch_fp8"), p) for p in points if p["M"] >= TARGET_ACCURATE_M]
    big = [(v, p) for v, p in big if v is not None]
    value, detail = None, ""
    if big:
        value, worst = min(big, key=lambda vp: vp[0])
        detail = f"worst {worst['shape']} M = {worst['M']}; {len(big)} points"
    items = [_target("accurate_x_torch_min", f"ours accurate row-wise fp8 / torch row-wise `_scaled_mm` at every M >= "
                     f"{TARGET_ACCURATE_M} (x, the lowest)", value, TARGET_ACCURATE_X_TORCH_MIN, ">=", detail)]
    errs = [((p.get("accuracy") or {})[path]["rel_fro"], p, path) for p in points for path in ACCURATE_ERROR_PATHS
            if path in (p.get("accuracy") or {})]
    value, detail = None, ""
    if errs:
        value, worst, path = max(errs, key=lambda e: e[0])
        detail = f"worst {path} at {worst['shape']} M = {worst['M']}; {len({id(p) for _, p, _ in errs})} points"
    items.append(_target("rel_err_fp8_accurate", "accurate row-wise fp8 relative error vs float64, bf16 out (the "
                         "highest)", value, TARGET_ACCURATE_REL, "<=", detail))
    return items


def flip_line(items: list[dict], default: Optional[bool]) -> str:
    """What issue 37's targets say about `FP8_FAST_ACCUM` (cutlass_w8a8/ops/_limits.py, ``default`` in the run):
    the accurate rows become the default (the flag flips to False) once both targets are met."""
    where = f"`FP8_FAST_ACCUM` (cutlass_w8a8/ops/_limits.py) was {default} in this run"
    if default is False:
        return f"- {where}: accurate row-wise fp8 is already the default."
    missed = [it["label"] for it in items if it["met"] is False]
    unjudged = [it["label"] for it in items if it["met"] is None]
    if missed:
        state = "not yet: " + "; ".join(missed) + (" missed" if len(missed) > 1 else " is missed")
    elif unjudged:
        state = "not judged: no number for " + "; ".join(unjudged)
    else:
        state = "both met in this run"
    return (f"- {where}; issue 37 flips it to False (accurate row-wise fp8 by default) when both targets above are "
            f"met: {state}.")


def render_markdown(results: dict[str, Any], geomean: Callable) -> str:
    """The whole report: a header, the per-point table, the summary and any baseline that did not run."""
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    peak = results.get("peak_tops")
    lines = [
        f"# W8A8 GEMM benchmark: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}",
        f"- L2 {results['l2_bytes'] / 2**20:.0f} MiB; device copy bandwidth {results['copy_GBps']:.0f} GB/s "
        f"(bytes read + written), read-only bandwidth {_fmt(results.get('read_GBps'), '.0f')} GB/s "
        f"(a float32 max-reduction); dense int8/fp8 peak {_fmt(peak, '.0f')} TOPS",
        f"- programmatic dependent launch (PDL) of our GEMMs: {'on' if results.get('pdl') else 'off'}. "
        "PDL gain = time with PDL off / time with it on (ours, and the whole W8A8Linear forward).",
        "- ours = `cutlass_w8a8.scaled_mm`, int8, per-token x per-channel scales, bf16 out. Times are "
        "cold-L2 CUDA-graph replays over rotating input copies, median of "
        f"{results['timing']['replays']} replays; the replays of a point's methods are interleaved, so all run "
        "under the same clocks.",
        "- x bf16 / x fp8-torch / x int_mm: time of cuBLAS bf16 / `torch._scaled_mm` fp8 row-wise / "
        "`torch._int_mm` + scaling, divided by ours (> 1: ours is faster). Weight GB/s: N*K bytes per call.",
        "- quant share: the quantization kernel's time / the W8A8Linear forward's; quant visible: "
        "1 - GEMM time / forward time, what quantizing adds to the forward.",
        "- fp8 acc = `cutlass_w8a8.scaled_mm(..., fp8_fast_accum=False)` on ours fp8's operands (the accurate "
        "row-wise fp8 rows, promoted into float32 every 128 of K); fp8 acc x fp8-torch = `torch._scaled_mm`'s time / "
        "its, fp8 acc x fp8 = our fast-accumulation fp8's time / its (< 1: what accuracy costs).",
        *torchao_notes(results),
        "",
        "## Per shape and M",
        "",
        point_table(results["points"]),
        "",
        "## Geomean speedups by M",
        "",
        summary_table(results["points"], geomean),
    ]
    if _present(results["points"], TORCHAO_COLUMNS):
        lines += ["", "## W8A8Linear against torchao, per shape and M", "", torchao_table(results["points"])]
    if results.get("fp8_accurate_targets"):
        items = results["fp8_accurate_targets"]
        lines += ["", "## Targets (issue 37): accurate row-wise fp8", "", *targets_lines(items),
                  flip_line(items, results.get("fp8_fast_accum_default"))]
    notes = error_notes(results["points"])
    return markdown(lines, ("## Baselines that did not run", [notes] if notes else []))


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: speedup of ours (int8) over bf16 against M, and our TOPS against M; one line per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (ax_speed, ax_tops) = plt.subplots(1, 2, figsize=(13, 5))
    for shape in dict.fromkeys(p["shape"] for p in results["points"]):
        pts = sorted((p for p in results["points"] if p["shape"] == shape), key=lambda p: p["M"])
        for ax, key in ((ax_speed, "ours_x_bf16"), (ax_tops, "ours_tops")):
            xy = [(p["M"], p["derived"][key]) for p in pts if p["derived"][key] is not None]
            if xy:
                ax.plot(*zip(*xy), marker="o", markersize=3, label=shape)
    ax_speed.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_speed.set_ylabel("speedup over bf16 cuBLAS (x)")
    ax_speed.set_title("cutlass_w8a8 int8 vs torch.matmul bf16")
    ax_tops.set_yscale("log")
    ax_tops.set_ylabel("TOPS (2·M·N·K / time)")
    ax_tops.set_title("cutlass_w8a8 int8 throughput")
    if results.get("peak_tops"):
        ax_tops.axhline(results["peak_tops"], color="gray", linestyle="--", linewidth=1)
        ax_tops.annotate("dense peak", xy=(0.01, results["peak_tops"]), xycoords=("axes fraction", "data"),
                         va="bottom", fontsize=8, color="gray")
    for ax in (ax_speed, ax_tops):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax_speed.legend(fontsize=8)
    save_figure(fig, path, f"W8A8 GEMM, {results['device']}, torch {results['torch_version']}")

