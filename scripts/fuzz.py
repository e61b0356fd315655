#!/usr/bin/env python3
"""Long fuzz run of cutlass_w8a8.scaled_mm against the float64 reference (the CI sample is tests/gemm/test_fuzz.py).

Each case is a random legal call (cutlass_w8a8/testing/fuzz.py, `random_case`): M in [1, 8192] (30% on a dispatch bucket
edge), N and K multiples of 16 up to 16384 (log-uniform), int8 and/or fp8, both output dtypes, every scale
kind and accepted scale shape, bias or not, functional or out=, aligned windows of wider buffers, and four
kinds of operand values. Every failing case is printed with a JSON line that reruns it (--case), then

    cases tried: N, mismatches: K

Exit status 1 on any mismatch (or error), 0 otherwise. For fp8 the script also prints the largest
`accum_rel` any case needed ("fp8 accum_rel needed"), to compare with cutlass_w8a8.testing.references.fp8_accum_bound.

Examples (GPU machine, from the repository root)::

    python scripts/fuzz.py --cases 1000 --seed 0 --dtypes int8,fp8
    python scripts/fuzz.py --case '{"m": 17, "n": 16, "k": 16, "dtype": "fp8"}'
    python scripts/fuzz.py --device cpu --cases 200 --max-m 64 --max-n 256 --max-k 256   # no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
import traceback



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--cases", type=int, default=1000, help="number of random cases (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case generator (default 0)")
    p.add_argument("--dtypes", default="int8,fp8", help="comma list of operand dtypes: int8, fp8")
    p.add_argument("--device", default="cuda", help="device of the operands (default cuda; cpu tests the "
                   "reference op)")
    p.add_argument("--ref-device", default=None, help="device of the float64 reference (default: --device)")
    p.add_argument("--max-m", type=int, default=8192)
    p.add_argument("--max-n", type=int, default=16384, help="a multiple of 16")
    p.add_argument("--max-k", type=int, default=16384, help="a multiple of 16")
    p.add_argument("--fp8-accum-rel", type=float, default=None,
                   help="fp8 allowance on sum|a*b| (default: cutlass_w8a8.testing.references.fp8_accum_bound(K) per case)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new cases after this long (the summary says so)")
    p.add_argument("--case", default=None, help="run only this case: JSON of Case fields (others default)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    for name in ("max_n", "max_k"):
        if getattr(args, name) < 16 or getattr(args, name) % 16:
            p.error(f"--{name.replace('_', '-')} must be a positive multiple of 16")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("int8", "fp8")]
    if bad or not args.dtypes:
        p.error(f"--dtypes: unknown {bad or 'empty list'}; use int8, fp8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing.fuzz import Case, random_case, run_case
    from cutlass_w8a8.testing.report import cuda_extension_missing

    device = torch.device(args.device)
    if device.type == "cuda":
        missing = cuda_extension_missing("fuzz.py")
        if missing is not None:
            print(f"{missing} (--device cpu fuzzes the reference op)", file=sys.stderr)
            return 2
        print(f"device: {torch.cuda.get_device_name(device)}; {cw.extension_status()}", flush=True)
    accum_rel = args.fp8_accum_rel  # None: cutlass_w8a8.testing.references.fp8_accum_bound(K) per case

    if args.case is not None:
        fields = json.loads(args.case)
        fields.setdefault("m", 1), fields.setdefault("n", 16), fields.setdefault("k", 16)
        todo = [Case(**fields)]
    else:
        rng = random.Random(args.seed)
        todo = (random_case(rng, args.dtypes, args.max_m, args.max_n, args.max_k) for _ in range(args.cases))

    stats: dict = {}
    tried = mismatches = 0
    by_dtype: dict = {}
    t0 = time.time()
    stopped_early = False
    for case in todo:
        if args.max_seconds is not None and time.time() - t0 > args.max_seconds:
            stopped_early = True
            break
        tried += 1
        by_dtype[case.dtype] = by_dtype.get(case.dtype, 0) + 1
        try:
            run_case(case, device, args.ref_device, accum_rel, stats)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # surface asynchronous errors with the case that caused them
        except Exception as exc:  # noqa: BLE001 (a crash is a mismatch too; keep going where possible)
            mismatches += 1
            kind = "MISMATCH" if isinstance(exc, AssertionError) else f"ERROR {type(exc).__name__}"
            print(f"{kind} case {tried}: {exc}", flush=True)
            print(f"  rerun: python scripts/fuzz.py --device {args.device} --case "
                  f"'{json.dumps(dataclasses.asdict(case))}'", flush=True)
            if not isinstance(exc, AssertionError):
                traceback.print_exc(limit=3)
            msg = str(exc)
            if device.type == "cuda" and ("CUDA error" in msg or "illegal" in msg or "CUBLAS" in msg):
                print("the CUDA context is unusable after this error; stopping", flush=True)
                stopped_early = True
                break
        if not args.quiet and tried % 100 == 0:
            print(f"... {tried} cases, {mismatches} mismatches, {time.time() - t0:.0f} s", flush=True)

    elapsed = time.time() - t0
    print(f"per dtype: {', '.join(f'{k}: {v}' for k, v in sorted(by_dtype.items()))}; {elapsed:.1f} s")
    if "fp8_accum_rel_needed" in stats:
        need = stats["fp8_accum_rel_needed"]
        exp = f" (2**{math.log2(need):.1f})" if 0 < need < math.inf else ""
        allowed = "K * 2**-13 per case" if accum_rel is None else f"{accum_rel:.3g}"
        print(f"fp8 accum_rel needed: {need:.3g}{exp}; allowed: {allowed}"
              + ("  [inf: an error where every term is 0, not an accumulation error]" if need == math.inf else ""))
    if "fp8_bound_fraction" in stats:
        print(f"fp8: the largest accumulation error used {stats['fp8_bound_fraction']:.3g} of its bound K * 2**-13 * sum|terms|")
    if stopped_early:
        print(f"stopped early after {tried} of {len(todo) if isinstance(todo, list) else args.cases} cases")
    print(f"cases tried: {tried}, mismatches: {mismatches}", flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
