"""Does a GEMM row's result depend on M? Issue 37's invariance question, measured on a GPU.

For each scheme (int8 per-token x per-channel; fp8 row-wise with fast accumulation and, where the build has it,
accurate; block-scaled fp8 1x128 x 128x128), each (N, K) shape and each M in the list, the script computes
``scaled_mm(a[:M], ...)`` on fresh random operands (the same ``a`` rows for every M: the first M rows of one
``max(M)``-row matrix, quantized per row, so every row's quantized bytes and scales are the same whatever M) and
compares each result with the rows of the largest M's result, bit for bit. A row whose bits change with M is what
breaks "eager equals every CUDA-graph bucket" when a decoder step is captured at a padded batch size.

Reports, per scheme, shape and M: the elements that differ from the reference M's (count, and the largest
difference in units of the output's last place), plus the kernel family the dispatch chose (decode GEMM at small
M, a CUTLASS config above), as far as the profiler names it. Each M is also compared with the largest M of its own
family (``class``: ``decode`` for M <= ``cutlass_w8a8._ext.decode_gemm_max_m()``, the rule of
csrc/core/launch_policy.hpp, else ``cutlass``): the guarantee of issue 37 is that rows agree within a family, and
the bucket sets of the graph runners hold the family bounds (`cutlass_w8a8.runner.dispatch_bounds`). Writes ``m_invariance_<device>.{json,md}`` to
``--out``. GPU only (sm90 for block fp8).

    python scripts/m_invariance.py --out /tmp/inv
    python scripts/m_invariance.py --m 1,2,4,8,9,16,17,32,64,128,129,256 --schemes block
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.linear import quantize_weight_blocks  # noqa: E402

M_DEFAULT = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129, 255, 256]
SHAPES_DEFAULT = [(4096, 4096), (2112, 7168), (7168, 2048)]  # (N, K): Llama-3-8B o, DeepSeek-V3 q_a / down-like
SCHEMES = ("int8", "fp8-fast", "fp8-accurate", "block")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default=",".join(map(str, M_DEFAULT)), help="comma list of M (the largest is the reference)")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES_DEFAULT), help="comma list of NxK")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma list among {', '.join(SCHEMES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for m_invariance_<device>.{json,md} (default: print only)")
    args = p.parse_args(argv)
    try:
        args.m_list = sorted({int(x) for x in args.m.split(",") if x.strip()})
        args.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s.strip()]
    except ValueError:
        p.error("--m: integers; --shapes: NxK pairs")
    if not args.m_list or args.m_list[0] < 1:
        p.error("--m: positive integers")
    if any(len(s) != 2 or s[0] < 16 or s[0] % 16 or s[1] < 128 or s[1] % 128 for s in args.shape_list):
        p.error("--shapes: N a positive multiple of 16 and K of 128 (block fp8's groups)")
    args.scheme_list = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in args.scheme_list if s not in SCHEMES]
    if bad:
        p.error(f"--schemes: unknown {bad}")
    return args


def has_accurate_fp8() -> bool:
    """Whether this package's scaled_mm takes ``fp8_fast_accum`` (issue 37's accurate row-wise fp8)."""
    import inspect
    return "fp8_fast_accum" in inspect.signature(cw.scaled_mm).parameters


def operands(scheme: str, m_max: int, n: int, k: int, gen: torch.Generator):
    """(a, scale_a, b (K, N) column-major, scale_b, extra kwargs) for the largest M; rows quantized one by one."""
    x = torch.randn(m_max, k, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda", dtype=torch.float32) / k ** 0.5).to(torch.bfloat16)
    kw = {}
    if scheme == "int8":
        a, sa = cw.quantize_int8(x)
        q, sb = cw.quantize_int8(w)
    elif scheme == "block":
        a, sa = cw.quantize_per_token_group(x, 128, torch.float8_e4m3fn)
        q, sb = quantize_weight_blocks(w, torch.float8_e4m3fn)
    else:
        a, sa = cw.quantize_fp8(x)
        q, sb = cw.quantize_fp8(w)
        if has_accurate_fp8():
            kw["fp8_fast_accum"] = scheme == "fp8-fast"
    return a, sa, q.t(), sb, kw


def ulp_diff(got: torch.Tensor, ref: torch.Tensor) -> int:
    """The largest |got - ref| in units of ref's last place (bf16: 2^(exponent - 7))."""
    d = (got.float() - ref.float()).abs()
    if not bool((d > 0).any()):
        return 0
    exp = torch.frexp(ref.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))[1] - 1
    ulp = torch.ldexp(torch.ones_like(d), exp - 7)
    return int((d / ulp).max().ceil().item())


def kernel_name(fn) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    short = []
    for nm in names:
        if "decode_gemm_kernel" in nm:
            short.append("decode_gemm")
        elif "decode_reduce_kernel" in nm:
            continue
        elif "GemmUniversal" in nm or "cutlass" in nm:
            short.append("cutlass " + ("blockwise" if "Blockwise" in nm or "BlockScal" in nm else
                                       "waves" if "Wave" in nm else "sm90"))
        else:
            short.append(nm.split("<")[0].split("(")[0][-40:])
    return "+".join(dict.fromkeys(short)) or "?"


def run(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    m_max = args.m_list[-1]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "m": args.m_list, "points": [],
               "decode_gemm_max_m": cw._ext.decode_gemm_max_m()}
    for scheme in args.scheme_list:
        if scheme == "fp8-accurate" and not has_accurate_fp8():
            print(f"{scheme}: this build's scaled_mm has no fp8_fast_accum argument; skipped")
            continue
        for n, k in args.shape_list:
            a, sa, b, sb, kw = operands(scheme, m_max, n, k, gen)
            ref = cw.scaled_mm(a, b, sa, sb, torch.bfloat16, **kw)
            bound = cw._ext.decode_gemm_max_m()
            family = {m: "decode" if m <= bound else "cutlass" for m in args.m_list}
            family_ref = {}
            for fam in set(family.values()):
                m_ref = max(m for m in args.m_list if family[m] == fam)
                family_ref[fam] = (m_ref, cw.scaled_mm(a[:m_ref], b, sa[:m_ref], sb, torch.bfloat16, **kw))
            for m in args.m_list:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
                cw.scaled_mm(a[:m], b, sa[:m], sb, out=out, **kw)
                torch.cuda.synchronize()
                diff = (out.view(torch.int16) != ref[:m].view(torch.int16))
                m_fam, ref_fam = family_ref[family[m]]
                diff_fam = (out.view(torch.int16) != ref_fam[:m].view(torch.int16))
                point = {"scheme": scheme, "n": n, "k": k, "m": m, "class": family[m], "class_ref_m": m_fam,
                         "class_differ": int(diff_fam.sum().item()), "class_max_ulp": ulp_diff(out, ref_fam[:m]),
                         "differ": int(diff.sum().item()),
                         "rows_differ": int(diff.any(dim=1).sum().item()), "max_ulp": ulp_diff(out, ref[:m]),
                         "nan": int(out.isnan().sum().item()),
                         "kernel": kernel_name(lambda: cw.scaled_mm(a[:m], b, sa[:m], sb, torch.bfloat16, **kw))}
                results["points"].append(point)
                print(f"{scheme:13s} N {n:5d} K {k:5d} M {m:4d}: {point['differ']:7d} elements differ from M = "
                      f"{m_max} ({point['rows_differ']} rows, max {point['max_ulp']} ulp, NaN {point['nan']}); "
                      f"{point['kernel']}; class {family[m]}: {point['class_differ']} differ from M = {m_fam}")
                sys.stdout.flush()
    return results


def render(results: dict) -> str:
    m_max = results["m"][-1]
    lines = [f"# Does a row's GEMM result depend on M? {results['device']}", "",
             f"torch {results['torch']}. Each row of `scaled_mm(a[:M])` against the same row of `scaled_mm(a[:{m_max}])`"
             f" (same quantized bytes and scales), bit for bit; bfloat16 output. Written by scripts/m_invariance.py.",
             f"The class columns compare with the largest M of the same kernel family (decode: M <= "
             f"decode_gemm_max_m() = {results.get('decode_gemm_max_m', '?')}; cutlass above).",
             "", "| scheme | N | K | M | kernel | elements differing | rows differing | max ulp | class | vs M | "
             "class elements differing | class max ulp |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for p in results["points"]:
        lines.append(f"| {p['scheme']} | {p['n']} | {p['k']} | {p['m']} | {p['kernel']} | {p['differ']} | "
                     f"{p['rows_differ']} | {p['max_ulp']} | {p['class']} | {p['class_ref_m']} | "
                     f"{p['class_differ']} | {p['class_max_ulp']} |")
    lines += ["", "## Invariant schemes", ""]
    for scheme in dict.fromkeys(p["scheme"] for p in results["points"]):
        pts = [p for p in results["points"] if p["scheme"] == scheme]
        bad = sorted({p["m"] for p in pts if p["differ"] or p["nan"]})
        lines.append(f"- {scheme}: " + ("every M gives the same bits" if not bad else f"differs at M = {bad}"))
        for fam in dict.fromkeys(p["class"] for p in pts):
            bad = sorted({p["m"] for p in pts if p["class"] == fam and (p["class_differ"] or p["nan"])})
            lines.append(f"  - {fam} family: " + ("the same bits at every M of the family" if not bad else
                                                   f"differs from its largest M at M = {bad}"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("m_invariance.py needs a CUDA GPU")
        return 2
    results = run(args)
    md = render(results)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        dev = results["device"].lower().replace(" ", "-")
        with open(os.path.join(args.out, f"m_invariance_{dev}.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, f"m_invariance_{dev}.md"), "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
