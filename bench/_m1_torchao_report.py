"""bench/bench_m1_torchao.py's numbers and report, none of which needs a GPU: the method names, `derive` (ratios
and weight TB/s of a point), the targets (`evaluate_target`, `evaluate_targets`), `render_markdown` of a
results dict, and `plot_results` (needs matplotlib; prints a note without it).

A point of ``results["points"]`` holds at least ``shape``, ``M``, ``time_us`` (method -> us per call),
``errors`` (method -> message) and ``derived`` (`derive`'s output); optionally ``timing_method`` (method ->
"graph" or "eager") and ``timing_notes`` (method -> why it was timed eagerly).
"""

from __future__ import annotations

from typing import Any, Optional

from cutlass_w8a8.testing.report import markdown, save_figure
from cutlass_w8a8.testing.timers import geomean

METHODS = ("w8a8", "w8a8_fp8", "torchao_int8wo", "bf16")
LABELS = {"w8a8": "W8A8Linear", "w8a8_fp8": "W8A8Linear fp8", "torchao_int8wo": "ao int8wo", "bf16": "bf16"}
# (key, baseline method, our method): ratio = t(baseline) / t(ours), > 1: ours is faster.
RATIOS = (("w8a8_x_torchao", "torchao_int8wo", "w8a8"), ("w8a8_fp8_x_torchao", "torchao_int8wo", "w8a8_fp8"),
          ("w8a8_x_bf16", "bf16", "w8a8"), ("w8a8_fp8_x_bf16", "bf16", "w8a8_fp8"))
# (ratio key, threshold, text): one report line per target and M. The first is issue 18's.
TARGETS = (("w8a8_x_torchao", 1.0, "`W8A8Linear` >= 1.0x torchao int8 weight-only + compile on every shape"),
           ("w8a8_fp8_x_torchao", 1.0, "`W8A8Linear` fp8 >= 1.0x torchao int8 weight-only + compile on every shape"),
           ("w8a8_x_bf16", 1.0, "`W8A8Linear` >= 1.0x bf16 `nn.Linear` on every shape"))


def derive(time_us: dict[str, float], weight_bytes: dict[str, int]) -> dict[str, Any]:
    """``{"ratios": {key: t(baseline) / t(ours) or None}, "weight_TBps": {method: bytes / time in 1e12 B/s}}``
    from times in us and weight bytes per method (a method missing from either gives no figure)."""
    ratios = {key: (time_us[base] / time_us[ours] if base in time_us and ours in time_us else None)
              for key, base, ours in RATIOS}
    tbps = {name: weight_bytes[name] / (t * 1e-6) / 1e12 for name, t in time_us.items() if name in weight_bytes}
    return {"ratios": ratios, "weight_TBps": tbps}


def evaluate_target(points: list[dict], key: str, m: int, threshold: float = 1.0) -> dict[str, Any]:
    """The verdict of one target at one M over the points of that M.

    ``status``: "not measured" (no point has the ratio), "NOT met" (some ratio < ``threshold``), "incomplete"
    (none below, but some shape has no ratio: ``missing``), else "met". ``worst``: ``(shape, ratio)`` of the
    smallest ratio or None; ``geomean`` of the ratios or None; ``n`` ratios counted."""
    at_m = [p for p in points if p["M"] == m]
    have = [(p["shape"], p["derived"]["ratios"].get(key)) for p in at_m]
    ratios = [(s, r) for s, r in have if r is not None]
    missing = [s for s, r in have if r is None]
    worst = min(ratios, key=lambda sr: sr[1]) if ratios else None
    if not ratios:
        status = "not measured"
    elif worst[1] < threshold:
        status = "NOT met"
    elif missing:
        status = "incomplete"
    else:
        status = "met"
    return {"key": key, "M": m, "threshold": threshold, "status": status, "worst": worst, "missing": missing,
            "geomean": geomean([r for _, r in ratios]), "n": len(ratios)}


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """`evaluate_target` for every target of `TARGETS` and M of the run, with its ``text``; the fp8 target only
    when ``results["fp8"]``."""
    out = []
    for key, threshold, text in TARGETS:
        if "fp8" in key and not results.get("fp8"):
            continue
        for m in results["m_values"]:
            out.append({**evaluate_target(results["points"], key, m, threshold), "text": text})
    return out


def fmt(value: Optional[float], spec: str) -> str:
    """``format(value, spec)``, or "–" for None."""
    return "–" if value is None else format(value, spec)


def target_lines(results: dict[str, Any]) -> list[str]:
    """One Markdown bullet per target and M: the verdict, the worst shape and the geomean."""
    lines = []
    for t in evaluate_targets(results):
        worst = f"worst: {t['worst'][0]}, {t['worst'][1]:.3f}x" if t["worst"] else "no ratio"
        extra = f"; no ratio at {', '.join(t['missing'])}" if t["missing"] and t["worst"] else ""
        lines.append(f"- M = {t['M']}: {t['text']}: **{t['status']}** ({worst}; geomean "
                     f"{fmt(t['geomean'], '.3f')}x over {t['n']} shapes{extra})")
    return lines


def _present(points: list[dict]) -> list[str]:
    return [name for name in METHODS if any(name in p["time_us"] for p in points)]


def point_table(points: list[dict]) -> str:
    """One row per (shape, M): us per method (``†``: eager fallback timing), the ratios, weight TB/s."""
    names = _present(points)
    ratio_cols = [(key, f"{LABELS[ours]} x {LABELS[base]}") for key, base, ours in RATIOS
                  if any(p["derived"]["ratios"].get(key) is not None for p in points)]
    heads = [f"{LABELS[n]} us" for n in names] + [h for _, h in ratio_cols] + [f"{LABELS[n]} TB/s" for n in names]
    rows = ["| shape | M | " + " | ".join(heads) + " |", "|:---|---:|" + "---:|" * len(heads)]
    for p in points:
        cells = []
        for n in names:
            mark = "†" if p.get("timing_method", {}).get(n) == "eager" else ""
            cells.append(fmt(p["time_us"].get(n), ".1f") + (mark if n in p["time_us"] else ""))
        cells += [fmt(p["derived"]["ratios"].get(key), ".2f") for key, _ in ratio_cols]
        cells += [fmt(p["derived"]["weight_TBps"].get(n), ".2f") for n in names]
        rows.append(f"| {p['shape']} | {p['M']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(results: dict[str, Any]) -> str:
    """The report: provenance, how it was measured, the targets, the table, and what did not run."""
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    ao = results["torchao"]
    if ao.get("enabled"):
        ao_text = (f"torchao {ao['version']}: `quantize_(copy of the linear, {ao.get('config') or '?'})`, "
                   f"called through `{ao['compile']}`" + ("" if ao.get("fullgraph", True) else
                                                          " (fullgraph=False: dynamo reported a graph break)"))
        if ao.get("left_out"):
            ao_text += f"; left out after the first shape: {ao['left_out']}"
    else:
        ao_text = f"torchao: not timed ({ao.get('reason') or 'not run'})"
    tol = results.get("tolerances", {})
    points = results["points"]
    ran = {name for p in points for name in (*p["time_us"], *p["errors"])}
    errors = [f"- `{name}` at {p['shape']} M={p['M']}: `{msg}`" for p in points for name, msg in p["errors"].items()]
    eager = [f"- `{name}` at {p['shape']} M={p['M']}: {why}" for p in points
             for name, why in p.get("timing_notes", {}).items()]
    lines = [
        f"# W8A8Linear at M = {','.join(map(str, results['m_values']))} against torchao int8 weight-only + "
        f"torch.compile: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}; L2 "
        f"{results['l2_bytes'] / 2**20:.0f} MiB; datasheet HBM bandwidth "
        f"{fmt(results.get('hbm_GBps_datasheet'), '.0f')} GB/s; PDL {'on' if results.get('pdl') else 'off'}",
        f"- {ao_text}.",
        "- All methods from one bf16 `nn.Linear(K, N, bias=False)` per shape, fresh `x = randn(M, K)` bf16 per point. "
        "W8A8Linear = `W8A8Linear.from_float` (default W8A8Config: int8, per-channel weights, dynamic per-token "
        "activations), called eagerly: quantization included. bf16 = the `nn.Linear` (cuBLAS).",
        "- Times: cold-L2 CUDA-graph replays over rotating copies of the input and the module (weights included), "
        f"median of {results['timing']['replays']} replays, the methods of a point interleaved; † = CUDA-graph "
        "timing failed, CUDA events around eager calls instead (host overhead included).",
        "- Ratios: `A x B` = t(B) / t(A), > 1: A is faster. TB/s = bytes of the module's weights and scales / time.",
        "- Checked before timing against the fp32 `x @ W^T` (relative Frobenius error bounds: "
        + ", ".join(f"{LABELS[n]} {tol[n]:g}" for n in METHODS if n in tol and n in ran) + ").",
        f"- Elapsed {fmt(results.get('elapsed_s'), '.1f')} s"
        + (f", torchao's first calls (compiles) {results['torchao_compile_s']:.1f} s of it."
           if results.get("torchao_compile_s") is not None else "."),
        "",
        "## Targets",
        "",
        *target_lines(results),
        "",
        "## Per shape and M",
        "",
        point_table(points),
    ]
    return markdown(lines, ("## Timed eagerly", eager), ("## Methods that did not run or were too inaccurate", errors))


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: per (shape, M), W8A8Linear's speedup over torchao int8wo and over bf16 (bars; 1.0 dashed). Prints a
    note and writes nothing without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"bench_m1_torchao.py: matplotlib is not installed; no plot at {path}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    labels = [f"{p['shape']}\nM={p['M']}" for p in points]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(points)), 4.5))
    width = 0.4
    for i, (key, text) in enumerate((("w8a8_x_torchao", "t(ao int8wo) / t(W8A8Linear)"),
                                     ("w8a8_x_bf16", "t(bf16) / t(W8A8Linear)"))):
        xy = [(j + (i - 0.5) * width, p["derived"]["ratios"].get(key)) for j, p in enumerate(points)]
        xy = [(x, y) for x, y in xy if y is not None]
        if xy:
            ax.bar(*zip(*xy), width=width, label=text, color=f"C{i}")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(points)), labels, fontsize=7)
    ax.set_ylabel("speedup of W8A8Linear (x)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ao = results["torchao"]
    versions = f"torch {results['torch_version']}" + (f", torchao {ao['version']}" if ao.get("enabled") else "")
    fig.suptitle(f"W8A8Linear vs torchao int8 weight-only + compile\n{results['device']}, {versions}", fontsize=9)
    save_figure(fig, path)


