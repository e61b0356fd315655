"""Measure every sm90 kernel config on the Llama-3 shapes, to choose the dispatch table by measurement.

Needs a build with the tuning candidates (all tables, or only those to be swept)::

    CUTLASS_W8A8_TUNE=1 TORCH_CUDA_ARCH_LIST=9.0a pip install --no-build-isolation -e .
    python bench/tune_sm90.py --out bench/results
    CUTLASS_W8A8_TUNE=fp8-block TORCH_CUDA_ARCH_LIST=9.0a pip install --no-build-isolation -e .
    python bench/tune_sm90.py --dtypes fp8-block --m 256,1024 --shapes dsv3

A table whose candidates the build left out is swept over its shipped configs only (the log lists the configs).

For each config table (``--dtypes``: ``int8``, ``fp8``: per-token x per-channel scales on the Llama-3 shapes;
``fp8-block``: block-scaled fp8, 1x128 activation groups x 128x128 weight blocks, on the DeepSeek-V3 and Qwen3 shapes
of `cutlass_w8a8.testing.shapes.BLOCK_SHAPES`), shape and M, every config (shipped ones and candidates, bfloat16
output) is checked against the default config's output, or ``--reference``'s (relative error below 2e-2 for fp8, 1e-6
for int8; whether it is also bit-identical is recorded) and timed by CUDA-graph replay over rotating inputs with a
cold L2, the replays of a point's configs interleaved (cutlass_w8a8.testing.timers.bench_gpu_time_interleaved).
``--configs waves`` times the wave-mainloop candidates (names ending ``_waves``: csrc/gemm/sm90/wave_mainloop.cuh)
beside each point's shipped choice. Writes ``tune_<device>_<dtypes>.json`` (every time) and
``tune_<device>_<dtypes>.md``: the best config per point, for each M the config that is best in geomean over the
shapes with its loss against the per-point best, and for each M every config's geomean time ratio against the config
the shipped dispatch picks at each point (the library's ``cw8a8_sm90_select_config``), the table to read when deciding
whether a candidate should replace a shipped bucket, and for each config at how many of its points its output equaled
the reference's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional

import torch

from cutlass_w8a8.ops._limits import FP8_FAST_ACCUM

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [
    ("l3-8b-qkv", 6144, 4096), ("l3-8b-o", 4096, 4096), ("l3-8b-gate_up", 28672, 4096),
    ("l3-8b-down", 4096, 14336), ("l3-70b-qkv", 10240, 8192), ("l3-70b-o", 8192, 8192),
    ("l3-70b-gate_up", 57344, 8192), ("l3-70b-down", 8192, 28672),
]
M_VALUES = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# fp8-block's default: M <= 8 runs the decode GEMM, not a table config (M = 16 does only when decode_gemm_max_m()
# is 16 and the call is not forced)
BLOCK_M_VALUES = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# cw8a8_config_table in csrc/gemm/kernel_api.h: the ids of the int8 and fp8 tables equal their cw8a8_ab_type
TABLES = {"int8": 0, "fp8": 1, "fp8-block": 2}
BLOCK = 128  # cutlass_w8a8.ops._limits.BLOCK_SIZE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="int8,fp8",
                   help="comma list of config tables: int8, fp8, fp8-block (default int8,fp8)")
    p.add_argument("--m", default=None,
                   help=f"comma list of M values (default {','.join(map(str, M_VALUES))}; fp8-block "
                        f"{','.join(map(str, BLOCK_M_VALUES))})")
    p.add_argument("--shapes", default=None, help="comma list of substrings to select shapes (e.g. dsv3, q3-8b)")
    p.add_argument("--configs", default=None,
                   help="comma list of substrings: time only the configs whose name contains one (the shipped "
                        "choice of each point is always timed)")
    p.add_argument("--reference", default=None,
                   help="the config (a name of the table, e.g. 128x128x128_c2x1_pingpong_persistent) whose output every "
                        "config is checked and compared bit for bit against (default: the default dispatch's)")
    p.add_argument("--fp8-accum", choices=("fast", "accurate"), default=None,
                   help="row-wise fp8: the shipped choice and the default reference are the dispatch's among the "
                        "fast-accumulation or the accurate configs (scaled_mm's fp8_fast_accum; default: the package "
                        "default, cutlass_w8a8.ops._limits.FP8_FAST_ACCUM)")
    p.add_argument("--replays", type=int, default=10, help="timed graph replays per config (default 10)")
    p.add_argument("--replay-ms", type=float, default=0.5, help="target ms per replay (default 0.5)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    args = p.parse_args(argv)
    args.fp8_fast_accum = FP8_FAST_ACCUM if args.fp8_accum is None else args.fp8_accum == "fast"
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtype_list if d not in TABLES]
    if unknown or not args.dtype_list:
        p.error(f"--dtypes: unknown {unknown or args.dtypes!r}; choose among {', '.join(TABLES)}")
    try:
        args.m_list = [int(x) for x in args.m.split(",") if x.strip()] if args.m else None
    except ValueError:
        p.error(f"--m: a comma list of integers, got {args.m!r}")
    if args.m_list is not None and (not args.m_list or min(args.m_list) < 1):
        p.error(f"--m: M values must be >= 1, got {args.m!r}")
    return args


def m_values_for(dtype: str, m_list: Optional[list[int]]) -> list[int]:
    """The M values swept for a table: ``--m``'s, else `M_VALUES` (`BLOCK_M_VALUES` for ``fp8-block``)."""
    if m_list:
        return list(m_list)
    return list(BLOCK_M_VALUES if dtype == "fp8-block" else M_VALUES)


def shapes_for(dtype: str, filters: Optional[str]) -> list[tuple[str, int, int]]:
    """The shapes swept for a table: the Llama-3 linears, or for ``fp8-block`` the block-scaled models' shapes
    (`cutlass_w8a8.testing.shapes.BLOCK_SHAPES`), filtered by the comma-separated substrings of ``filters``."""
    from cutlass_w8a8.testing.shapes import BLOCK_SHAPES

    table = BLOCK_SHAPES if dtype == "fp8-block" else SHAPES
    return [s for s in table if not filters or any(f in s[0] for f in filters.split(","))]


def config_names(lib, dtype: str) -> list[str]:
    import ctypes

    lib.cw8a8_sm90_config_name.restype = ctypes.c_char_p
    count = lib.cw8a8_sm90_num_configs(TABLES[dtype])
    return [lib.cw8a8_sm90_config_name(TABLES[dtype], i).decode() for i in range(count)]


def shipped_index(lib, dtype: str, m: int, n: int, k: int, sms: int,
                  fp8_fast_accum: bool = FP8_FAST_ACCUM) -> Optional[int]:
    """The table index the library's dispatch picks for the shape (cw8a8_sm90_select_config; the fp8 table among its
    fast-accumulation or accurate configs by `fp8_fast_accum`), or None when the library predates that export."""
    import ctypes

    fn = getattr(lib, "cw8a8_sm90_select_config", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    index = fn(TABLES[dtype], m, n, k, sms, int(fp8_fast_accum))
    return index if index >= 0 else None


def plausible(name: str, m: int) -> bool:
    """Skip configs that cannot win at this M, to keep the sweep short.

    Swapped configs put the tokens on the MMA's N side: only useful while M is at most a few N tiles.
    Unswapped configs with 64 or more rows waste most of the MMA at M <= 16.
    """
    swap = name.startswith("swap_")
    if swap:
        tile_n = int(name.split("_")[1].split("x")[1])
        return m <= max(2 * tile_n, 32)
    return m >= 32


def scale_shapes(dtype: str, m: int, n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(scale_a, scale_b)`` shapes of a table's GEMM: per-token ``(M, 1)`` x per-channel ``(N,)``, or for
    ``fp8-block`` 1x128 groups ``(M, K/128)`` x 128x128 blocks ``(ceil(N/128), K/128)``."""
    if dtype == "fp8-block":
        return (m, k // BLOCK), (-(-n // BLOCK), k // BLOCK)
    return (m, 1), (n,)


def random_operands(dtype: str, m: int, n: int, k: int, copies: int):
    def q(*shape):
        if dtype == "int8":
            return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
        return torch.randn(shape, device="cuda").to(torch.float8_e4m3fn)

    sa_shape, sb_shape = scale_shapes(dtype, m, n, k)
    sets = []
    for _ in range(copies):  # weights rotate too: at small M the GEMM is a stream of the weight
        sets.append((torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), q(m, k), q(n, k),
                     torch.rand(sa_shape, device="cuda") * 1e-2 + 1e-3,
                     torch.rand(sb_shape, device="cuda") * 1e-2 + 1e-3))
    return sets


def tune_point(bu, dtype, names, m, n, k, args, l2_bytes, shipped: Optional[int] = None) -> dict:
    sa_shape, sb_shape = scale_shapes(dtype, m, n, k)
    set_bytes = m * k + n * k + 2 * m * n + 4 * (math.prod(sa_shape) + math.prod(sb_shape))
    copies = bu.rotation_count(set_bytes, l2_bytes, 4 * 2**30)
    sets = random_operands(dtype, m, n, k, copies)
    op = torch.ops.cutlass_w8a8._scaled_mm_config
    ref_out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    if getattr(args, "reference", None):
        op(ref_out, sets[0][1], sets[0][2].t(), sets[0][3], sets[0][4], None, names.index(args.reference))
    else:
        torch.ops.cutlass_w8a8.scaled_mm_out(ref_out, sets[0][1], sets[0][2].t(), sets[0][3], sets[0][4], None,
                                             getattr(args, "fp8_fast_accum", FP8_FAST_ACCUM))
    ref = ref_out.float()
    result = {"M": m, "N": n, "K": k, "times_us": {}, "errors": {}, "identical": {},
              "shipped": names[shipped] if shipped is not None and 0 <= shipped < len(names) else None}
    keys = [c.strip() for c in (args.configs or "").split(",") if c.strip()]
    cases = {}
    for i, name in enumerate(names):
        wanted = plausible(name, m) and (not keys or any(c in name for c in keys))
        if not wanted and name != result["shipped"]:
            continue
        out = sets[0][0]
        try:
            out.fill_(float("nan"))
            op(out, sets[0][1], sets[0][2].t(), sets[0][3], sets[0][4], None, i)
            rel = float((out.float() - ref).norm() / ref.norm())
            if not rel < (1e-6 if dtype == "int8" else 2e-2):  # int8 is exact: any config gives the same
                result["errors"][name] = f"wrong result: relative error {rel:.3g}"
                continue
            result["identical"][name] = bool(torch.equal(out, ref_out))
            cases[name] = (lambda o, a, w, sa, sb, i=i: op(o, a, w.t(), sa, sb, None, i), sets)
        except RuntimeError as exc:
            result["errors"][name] = str(exc).splitlines()[0][:200]

    def on_error(name, exc):
        if not isinstance(exc, RuntimeError):
            raise exc
        result["errors"][name] = str(exc).splitlines()[0][:200]

    # interleaved replays: every config of the point under the same clocks (see bench_utils)
    timings = bu.bench_gpu_time_interleaved(cases, replay_ms=args.replay_ms, replays=args.replays, on_error=on_error)
    result["times_us"] = {name: t.median_ms * 1e3 for name, t in timings.items()}
    best = min(result["times_us"], key=result["times_us"].get) if result["times_us"] else None
    result["best"] = best
    return result


def summarize(points: list[dict], geomean) -> str:
    lines = []
    for dtype in sorted({p["dtype"] for p in points}):
        lines += [f"\n## {dtype}: best config per point\n", "| M | shape | best | us | 2nd | us |",
                  "|---:|:---|:---|---:|:---|---:|"]
        for p in (q for q in points if q["dtype"] == dtype):
            ranked = sorted(p["times_us"].items(), key=lambda kv: kv[1])
            first = ranked[0] if ranked else ("–", float("nan"))
            second = ranked[1] if len(ranked) > 1 else ("–", float("nan"))
            lines.append(f"| {p['M']} | {p['shape']} | {first[0]} | {first[1]:.1f} | {second[0]} | {second[1]:.1f} |")
        lines += [f"\n## {dtype}: one config per M (geomean over shapes of time / per-point best)\n",
                  "| M | best single config | loss vs per-point best | runner-up | loss |", "|---:|:---|---:|:---|---:|"]
        for m in sorted({p["M"] for p in points if p["dtype"] == dtype}):
            pts = [p for p in points if p["dtype"] == dtype and p["M"] == m and p["times_us"]]
            common = set.intersection(*(set(p["times_us"]) for p in pts)) if pts else set()
            scores = {c: geomean([p["times_us"][c] / min(p["times_us"].values()) for p in pts]) for c in common}
            ranked = sorted(scores.items(), key=lambda kv: kv[1])
            if not ranked:
                continue
            second = ranked[1] if len(ranked) > 1 else ("–", float("nan"))
            lines.append(f"| {m} | {ranked[0][0]} | {ranked[0][1]:.3f} | {second[0]} | {second[1]:.3f} |")
        lines += vs_shipped(points, dtype, geomean)
        lines += identical_to_reference(points, dtype)
    return "\n".join(lines)


def identical_to_reference(points: list[dict], dtype: str) -> list[str]:
    """Markdown lines: for each config, at how many of the points where it passed the check its bfloat16 output
    equaled the reference's bit for bit (the default dispatch's, or ``--reference``'s; ``torch.equal``: +0 and -0
    compare equal)."""
    counts: dict = {}
    for p in (q for q in points if q["dtype"] == dtype):
        for name, same in p.get("identical", {}).items():
            hit, total = counts.get(name, (0, 0))
            counts[name] = (hit + bool(same), total + 1)
    if not counts:
        return []
    lines = [f"\n## {dtype}: output bit-identical to the reference's\n", "| config | identical at | of points |",
             "|:---|---:|---:|"]
    lines += [f"| {name} | {hit} | {total} |" for name, (hit, total) in sorted(counts.items())]
    return lines


def vs_shipped(points: list[dict], dtype: str, geomean) -> list[str]:
    """Markdown lines: for each M, every config's time / the shipped choice's time at the same point (geomean and
    range over the shapes where both ran; < 1: faster than what ships), and at how many points it was the best."""
    pts = [p for p in points if p["dtype"] == dtype and p.get("shipped") in p["times_us"]]
    if not pts:
        return []
    lines = [f"\n## {dtype}: every config against the shipped choice (time / shipped time, < 1 is faster)\n"]
    for m in sorted({p["M"] for p in pts}):
        at_m = [p for p in pts if p["M"] == m]
        shipped = sorted({p["shipped"] for p in at_m})
        ratios: dict = {}
        wins: dict = {}
        for p in at_m:
            base = p["times_us"][p["shipped"]]
            for name, t in p["times_us"].items():
                ratios.setdefault(name, []).append(t / base)
            best = min(p["times_us"], key=p["times_us"].get)
            wins[best] = wins.get(best, 0) + 1
        ranked = sorted(ratios.items(), key=lambda kv: geomean(kv[1]))
        lines += [f"M = {m}: {len(at_m)} shapes; shipped: {', '.join(shipped)}\n",
                  "| config | geomean | min | max | shapes | best at |", "|:---|---:|---:|---:|---:|---:|"]
        for name, rs in ranked:
            lines.append(f"| {name} | {geomean(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} | {len(rs)} | "
                         f"{wins.get(name, 0)} |")
        lines.append("")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_sm90.py needs a CUDA device")
    import cutlass_w8a8 as cw
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.testing import timers as bu

    lib = _ext.kernel_library("_kernels_sm90")
    if lib is None or not cw.cuda_ops_available():
        sys.exit(f"tune_sm90.py: the sm90 kernels are not loaded: {cw.extension_status()}")
    from tqdm import tqdm

    dtypes = args.dtype_list
    m_values = {d: m_values_for(d, args.m_list) for d in dtypes}
    shapes = {d: shapes_for(d, args.shapes) for d in dtypes}
    l2_bytes = bu.l2_cache_bytes()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    points = []
    names_by_dtype = {d: config_names(lib, d) for d in dtypes}
    missing = [d for d, names in names_by_dtype.items() if args.reference and args.reference not in names]
    if missing:
        sys.exit(f"--reference {args.reference}: not a config of {', '.join(missing)} in this build")
    t_start = time.perf_counter()
    for d, names in names_by_dtype.items():
        print(f"{d}: {len(names)} configs: {', '.join(names)}", flush=True)
        print(f"{d}: M {','.join(map(str, m_values[d]))}; shapes {', '.join(s[0] for s in shapes[d])}", flush=True)
    bar = tqdm(total=sum(len(shapes[d]) * len(m_values[d]) for d in dtypes), mininterval=5, file=sys.stdout)
    with torch.no_grad():
        for dtype in dtypes:
            for shape, n, k in shapes[dtype]:
                for m in m_values[dtype]:
                    shipped = shipped_index(lib, dtype, m, n, k, sms, args.fp8_fast_accum)
                    p = tune_point(bu, dtype, names_by_dtype[dtype], m, n, k, args, l2_bytes, shipped)
                    p.update(dtype=dtype, shape=shape)
                    points.append(p)
                    bar.update()
                torch.cuda.empty_cache()
    bar.close()
    device = torch.cuda.get_device_name()
    slug = bu.device_slug(device)
    os.makedirs(args.out, exist_ok=True)
    report = (f"# sm90 config sweep: {device}\n\nbfloat16 out, per-token x per-channel scales (fp8-block: 1x128 "
              f"activation groups x 128x128 weight blocks), cold-L2 graph replays (median of {args.replays}); "
              f"torch {torch.__version__}; {sms} SMs; {time.perf_counter() - t_start:.0f} s.\n"
              + summarize(points, bu.geomean))
    stem = f"tune_{slug}_{'_'.join(dtypes)}"
    with open(os.path.join(args.out, f"{stem}.json"), "w", encoding="utf-8") as f:
        json.dump({"device": device, "configs": names_by_dtype, "points": points}, f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w", encoding="utf-8") as f:
        f.write(report + "\n")
    print(report)
    errors = {(p["dtype"], name, e) for p in points for name, e in p["errors"].items()}
    for e in sorted(errors)[:20]:
        print("error:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
