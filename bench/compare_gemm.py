"""Compare two bench_gemm.py result files (a before and an after build, run on one machine in one session).

For every M range (``bench/_gemm_report.py`` ``M_GROUP_BOUNDS``) and every method present in both files, prints
the geomean over the common points of ``t(before) / t(after)`` (> 1: the after build is faster) and of each
build's speedup over cuBLAS bf16 measured in its own run, ``t(bf16) / t(method)``: the ratio to a same-run baseline
cancels what differs between the two runs (clocks, the other process's warm-up). Writes a markdown table.

    python bench/compare_gemm.py BEFORE.json AFTER.json [--out FILE.md] [--min-m 32]
"""

from __future__ import annotations

import argparse
import json
import math

# bench/ is on sys.path as the script's own directory (python bench/compare_gemm.py), as for bench_gemm.py
from _gemm_report import M_GROUP_BOUNDS

METHODS = ("ours_int8", "linear_w8a8", "quant_int8")


def _key(point: dict) -> tuple:
    return point["shape"], point["M"]


def _group(m: int) -> str:
    lo = 1
    for hi in M_GROUP_BOUNDS:
        if hi is None or m <= hi:
            return f"{lo}–{hi}" if hi is not None else f"{lo}+"
        lo = hi + 1
    raise AssertionError("M_GROUP_BOUNDS ends with None")


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def compare(before: dict, after: dict, min_m: int = 1) -> list[dict]:
    """Rows ``{range, method, points, after_x_before, before_x_bf16, after_x_bf16}`` (geomeans)."""
    b = {_key(p): p["time_ms"] for p in before["points"] if p["M"] >= min_m}
    a = {_key(p): p["time_ms"] for p in after["points"] if p["M"] >= min_m}
    common = sorted(set(a) & set(b), key=lambda k: (k[1], k[0]))
    rows = []
    groups: dict[str, list] = {}
    for k in common:
        groups.setdefault(_group(k[1]), []).append(k)
    for g, keys in groups.items():
        for method in METHODS:
            ks = [k for k in keys if method in a[k] and method in b[k] and "bf16" in a[k] and "bf16" in b[k]]
            if not ks:
                continue
            rows.append({
                "range": g, "method": method, "points": len(ks),
                "after_x_before": _geomean([b[k][method] / a[k][method] for k in ks]),
                "before_x_bf16": _geomean([b[k]["bf16"] / b[k][method] for k in ks]),
                "after_x_bf16": _geomean([a[k]["bf16"] / a[k][method] for k in ks]),
            })
    return rows


def render(before: dict, after: dict, rows: list[dict], labels: tuple[str, str] = ("", "")) -> str:
    names = [label or (run.get("git_commit") or "?")[:12] for label, run in zip(labels, (before, after))]
    lines = [
        f"# bench_gemm: {names[1]} against {names[0]} ({after.get('device', '?')})", "",
        "Geomeans over the common (shape, M) points of each range. after x before = t(before) / t(after) "
        "(> 1: faster now); x bf16 = t(cuBLAS bf16) / t(method) within each run.", "",
        "| M | method | points | after x before | before x bf16 | after x bf16 | change of x bf16 |",
        "|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        change = r["after_x_bf16"] / r["before_x_bf16"] - 1
        lines.append(f"| {r['range']} | {r['method']} | {r['points']} | {r['after_x_before']:.3f} | "
                     f"{r['before_x_bf16']:.3f} | {r['after_x_bf16']:.3f} | {100 * change:+.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--out", default=None)
    p.add_argument("--min-m", type=int, default=1)
    p.add_argument("--labels", nargs=2, default=("", ""), metavar=("BEFORE", "AFTER"),
                   help="names of the two builds (default: the commits the files record)")
    args = p.parse_args()
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    text = render(before, after, compare(before, after, args.min_m), tuple(args.labels))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
