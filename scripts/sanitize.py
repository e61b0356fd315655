#!/usr/bin/env python3
"""Run every cutlass_w8a8 op under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

The cases are `cutlass_w8a8.testing.sanitize_cases`: every op of the schema (cutlass_w8a8/ops/_schema.py, the one
DEF block) in the modes it serves, each result checked (float64 references for the GEMMs, the CPU implementations
bit for bit for quantization and routing, the unfused chains for the fused quantizers, eager runs for CUDA-graph
replays). The run fails when an op of the schema is named by no case (coverage cannot rot silently) or a case does
not call an op it names. The cases and the ops they drive: ``--list``.

- row-wise ``scaled_mm`` / ``scaled_mm_out`` at one M per dispatch bucket (``--ms``), int8 and fp8, both output
  dtypes, bias, per-tensor and per-token scales, M = 0, windowed operands, a K tail; ``_scaled_mm_config`` with every
  entry of the int8, fp8 and block-fp8 tables forced;
- block-scaled fp8 (1x128 activation groups x 128x128 weight blocks): ``scaled_mm`` at decode and CUTLASS M,
  ``scaled_mm_decode`` at M <= 16, ``w8a8_linear`` with block weights;
- ``scaled_mm_decode`` / ``linear_decode`` (and out=) at M = 1..16, split-K and not; ``w8a8_linear`` per token,
  per tensor and block, decode and CUTLASS M;
- ``grouped_scaled_mm`` (and out=) int8, fp8 and block with empty experts and unrouted rows, T on both sides of the
  grouped decode bound and of the CUTLASS Small / Mid / Large switches, a K tail, offsets the device clamps;
- ``moe_topk_softmax``, ``moe_route`` (softmax / sigmoid, bias, grouped top-k), ``moe_align``, ``moe_permute_quant``,
  ``moe_unpermute`` (and out=);
- ``decode_attention`` (and out=), ``decode_attention_quant``, ``rope_kv_cache_``, ``decode_layer``;
- ``quantize_per_token`` / ``quantize_per_tensor`` (every kernel variant), ``quantize_per_token_group``,
  ``rms_norm``, ``fused_add_rms_norm``, ``rms_norm_quant`` and ``silu_mul`` / ``silu_mul_quant`` per token, per
  tensor and per 1x128 group, rows that take the sm90 cluster kernels;
- CUDA graphs (`cutlass_w8a8.graphs.capture`): the MoE chain and a decode step captured and replayed with new
  inputs; `UpdatableGraph` set_rows and ``_graph_update_scaled_mm`` (int8 and block fp8).

For each tool T this runs the driver (``--driver``, the cases in this process) twice under

    compute-sanitizer --tool T --error-exitcode 1 --print-limit 10000 python3 scripts/sanitize.py --driver ...

- the eager cases with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is its own cudaMalloc allocation and
  memcheck and initcheck see exact bounds (inside torch's cached blocks an overrun into a neighbour is invisible);
- the CUDA-graph cases with torch's caching allocator on (a graph captures into the allocator's private pool; with
  the caching off allocations during a capture are plain cudaMalloc / cudaFree, which breaks it).

Under initcheck the driver gets ``--prefill-outputs``: initcheck does not count the sm90 epilogue's TMA stores as
writes and reported each later read of those outputs (H200, compute-sanitizer of CUDA 13.0), so GEMM outputs that may
be stored by TMA are host-written NaN buffers (a skipped element stays NaN and fails the check), and w8a8_linear at
CUTLASS sizes (no out= form) runs without its output being read back. Likewise initcheck does not count the grouped
GEMM's per-SM TMA descriptor writes (``tensormap.cp_fenceproxy``) in its workspace, so under initcheck the driver runs
with ``CUTLASS_W8A8_ZERO_WORKSPACE=1``: the op zeroes that workspace first (csrc/gemm/grouped_mm_entry.cu).

Per tool it prints one summary line, then a line per driver process:

    memcheck: 24 cases, 0 errors (ours 0, elsewhere 0); drivers ok; 182 s
        eager: ERROR SUMMARY: 0 errors; DRIVER OK: 21 cases, 395 op calls on cuda; rc 0; 151 s; log ...

The error count is the sum of the tools' own summaries ("ERROR SUMMARY: N errors"; racecheck's "RACECHECK SUMMARY:
H hazards displayed (N errors, W warnings)"). "ours" are reports that name our kernels or libraries; "elsewhere" the
rest (torch's own kernels and allocations). Exit status 1 when a tool reports errors (--fail-on ours: only ours), a
driver fails, or a tool gives no summary (crash, timeout); 2 when compute-sanitizer is not found.

Examples (GPU machine, repository root)::

    python scripts/sanitize.py                            # all four tools, one after the other
    python scripts/sanitize.py --jobs 4 --quick-tools racecheck --timeout 520   # scripts/gpu_run.sh's stage
    python scripts/sanitize.py --tools racecheck --quick  # racecheck's selection: fewer shapes, every op
    python scripts/sanitize.py --tools memcheck --cases 'grouped|moe'
    python scripts/sanitize.py --env CUTLASS_W8A8_FORCE_ARCH=sm80   # int8 through the sm80 kernels
    python scripts/sanitize.py --device cpu               # every case on the CPU implementations, no sanitizer
    python scripts/sanitize.py --driver                   # the CUDA driver alone, no sanitizer
    python scripts/sanitize.py --list                     # the cases and the ops they drive
    python scripts/sanitize.py --dry-run                  # print the commands
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
DEFAULT_MS = "1,24,48,100,512,2048"  # cutlass_w8a8.testing.sanitize_cases.DEFAULT_MS
# The driver processes of one tool: (group of cases, torch's caching allocator on).
GROUPS = (("eager", False), ("graphs", True))
# Substrings that mark a report as ours: kernel names (CUTLASS device_kernel<...>, everything in the cutlass_w8a8
# namespace: per_token_*_kernel, rowwise_*_kernel, decode_gemm_kernel, ...) or host frames in our libraries.
OUR_MARKERS = ("cutlass", "cw8a8", "per_token", "per_tensor", "rowwise_", "decode_gemm", "decode_attention",
               "rope_kv_cache", "grouped_", "_kernels_sm", "_C.so")
# Lines of the report that are not findings.
_NOT_FINDINGS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                           r"Target application returned an error|Error: process didn't terminate|"
                           r"This application|Note:|No .* errors? found)", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------------
# the driver: runs the cases (under the sanitizer, or on the CPU)


def driver(args) -> int:
    import torch

    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing.sanitize_cases import Ctx, run_driver

    if args.device == "cuda" and (not torch.cuda.is_available() or not cw.cuda_ops_available()):
        print(f"DRIVER FAILED: --device cuda needs a GPU and the built extension ({cw.extension_status()}); "
              "--device cpu runs the cases on the CPU implementations", flush=True)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)  # many small ops: a thread pool only adds waiting (10x on a loaded 2-core machine)
    ctx = Ctx(args.device, quick=args.quick, prefill=args.prefill_outputs, ms=args.ms, n=args.n, k=args.k,
              configs=not args.no_configs)
    return run_driver(ctx, group=args.group, pattern=args.cases, out=lambda line: print(line, flush=True))


def list_cases() -> int:
    from cutlass_w8a8.ops._schema import OPS
    from cutlass_w8a8.testing.sanitize_cases import CASES, NOT_DRIVEN, coverage_errors

    for c in CASES:
        flags = [f for f, on in (("graphs", c.graphs), ("sm90", c.needs_sm90)) if on]
        print(f"{c.name}{' [' + ', '.join(flags) + ']' if flags else ''}: {', '.join(c.ops)}\n    {c.doc}")
    by_op = {op: [c.name for c in CASES if op in c.ops] for op in OPS}
    print("\nschema op -> cases:")
    for op, names in by_op.items():
        print(f"  {op}: {', '.join(names) or NOT_DRIVEN.get(op, 'NONE')}")
    errors = coverage_errors()
    for e in errors:
        print(f"COVERAGE ERROR: {e}")
    return 1 if errors else 0


# ----------------------------------------------------------------------------------------------------
# reading the sanitizer's report


def parse_report(text: str) -> dict:
    """Summary lines, error count, findings split into ours / elsewhere, and the driver's status, from the output
    of one sanitizer run."""
    summaries, findings, block = [], [], None
    for line in text.splitlines():
        if not line.startswith("========="):
            block = None
            continue
        body = line[len("========="):]
        content = body.strip()
        if not content:
            continue
        if "SUMMARY:" in content:
            summaries.append(content)
            block = None
        elif body.startswith("     ") or body.startswith("\t"):  # indented: detail of the current finding
            if block is not None:
                block.append(content)
        elif _NOT_FINDINGS.match(content):
            block = None
        else:
            block = [content]
            findings.append(block)
    ours = [b for b in findings if any(mk in line for line in b for mk in OUR_MARKERS)]
    others = [b for b in findings if b not in ours]
    # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards
    # displayed (N errors, W warnings)"
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", text) or \
        re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
    driver_line = next((ln for ln in text.splitlines() if ln.startswith("DRIVER ")), None)
    cases = re.match(r"DRIVER OK: (\d+) cases", driver_line or "")
    return dict(
        summaries=summaries,
        errors=int(m.group(1)) if m else None,
        ours=ours,
        others=others,
        driver_ok=bool(driver_line and driver_line.startswith("DRIVER OK")),
        driver_line=driver_line,
        cases=int(cases.group(1)) if cases else None,
        failed_cases=[ln for ln in text.splitlines() if ln.startswith("case ") and ": FAILED" in ln],
        case_seconds={m.group(1): float(m.group(2)) for m in re.finditer(
            r"^case (\S+): \w+ \(\d+ checks, \d+ op calls, ([\d.]+) s\)", text, re.MULTILINE)},
    )


def describe(block) -> str:
    """First line of a finding and where it happened, shortened: the first detail line that names our code,
    else the device location ("at ..."), else the first host frame outside the CUDA driver and runtime."""
    details = block[1:]
    where = (next((ln for ln in details if any(mk in ln for mk in OUR_MARKERS)), None)
             or next((ln for ln in details if ln.startswith("at ")), None)
             or next((ln for ln in details if ln.startswith("Host Frame")
                      and "libcuda.so" not in ln and "libcudart" not in ln), ""))
    s = block[0] + (f" | {where}" if where else "")
    return s if len(s) <= 240 else s[:237] + "..."


def tool_summary(tool: str, runs: list, fail_on: str = "any") -> tuple[bool, str]:
    """(clean, the tool's summary line) from its driver processes' parsed reports (`parse_report` dicts, each with
    ``group``, ``rc``, ``seconds`` and ``log`` added): ``memcheck: N cases, E errors (ours O, elsewhere X); drivers
    ok; T s``. Clean: every process printed the tool's summary and DRIVER OK, and no error counts (any, or with
    ``fail_on == "ours"`` none attributed to our code)."""
    cases = sum(r["cases"] or 0 for r in runs)
    counted = [r["errors"] for r in runs if r["errors"] is not None]
    missing = [r["group"] for r in runs if r["errors"] is None]
    errors = f"{sum(counted)} errors" + (f" (+ no summary from {', '.join(missing)})" if missing else "")
    ours, others = sum(len(r["ours"]) for r in runs), sum(len(r["others"]) for r in runs)
    bad_drivers = [r["group"] for r in runs if not r["driver_ok"]]
    drivers = "drivers ok" if not bad_drivers else f"driver FAILED ({', '.join(bad_drivers)})"
    seconds = sum(r["seconds"] for r in runs)
    clean = not missing and not bad_drivers and (not ours if fail_on == "ours" else sum(counted) == 0 and not ours)
    return clean, (f"{tool}: {cases} cases, {errors} (ours {ours}, elsewhere {others}); {drivers}; {seconds:.0f} s"
                   + ("" if clean else "  NOT CLEAN"))


# ----------------------------------------------------------------------------------------------------
# running the tools


def find_sanitizer(name: str):
    """The compute-sanitizer executable: ``name`` if it is a path or on PATH, else the CUDA toolkit's
    ($CUDA_HOME/bin, /usr/local/cuda/bin); None when there is none."""
    found = shutil.which(name)
    if found:
        return found
    if os.sep in name:
        return None
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base:
            path = os.path.join(base, "bin", name)
            if os.access(path, os.X_OK):
                return path
    return None


def run_killable(cmd: list, env: dict, timeout) -> tuple[str, object]:
    """(output, return code) of ``cmd`` (stdout and stderr together); on timeout its whole process group is killed
    (compute-sanitizer and the driver it started: killing only the sanitizer would leave the driver on the GPU) and
    the return code is None."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return out or "", None


def driver_command(args, group: str, tool: str) -> list:
    cmd = [args.python, os.path.abspath(__file__), "--driver", "--device", "cuda", "--group", group,
           "--ms", ",".join(map(str, args.ms)), "--n", str(args.n), "--k", str(args.k)]
    cmd += ["--quick"] if args.quick or tool in args.quick_tools else []
    cmd += ["--no-configs"] if args.no_configs else []
    cmd += ["--cases", args.cases] if args.cases else []
    # initcheck does not see the sm90 epilogue's TMA stores (see the module docstring)
    cmd += ["--prefill-outputs"] if tool == "initcheck" else []
    return cmd


def selected_groups(pattern: str | None) -> list:
    """The `GROUPS` with a case whose name matches ``pattern`` (all of them without one): a ``--cases`` pattern
    that names only eager cases runs no graphs driver, which would fail on an empty selection."""
    if not pattern:
        return list(GROUPS)
    from cutlass_w8a8.testing.sanitize_cases import select_cases

    return [(group, caching) for group, caching in GROUPS if select_cases(group, pattern)]


def run_tool(tool: str, args) -> tuple[bool, list]:
    """Both driver processes of ``tool``, one after the other within ``args.timeout`` seconds together. Returns
    (clean, the lines to print)."""
    lines, runs = [], []
    start = time.time()
    extra = dict(kv.split("=", 1) for kv in args.env)
    for group, caching in selected_groups(args.cases):
        env_add = dict(extra)
        if not caching and not args.keep_caching:
            env_add["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        if tool == "initcheck":  # the grouped GEMM's TMA descriptors, written by cp_fenceproxy (grouped_mm_entry.cu)
            env_add["CUTLASS_W8A8_ZERO_WORKSPACE"] = "1"
        cmd = ([args.sanitizer, "--tool", tool, "--error-exitcode", "1", "--print-limit", "10000"]
               + args.sanitizer_arg + driver_command(args, group, tool))
        log = os.path.join(args.log_dir, f"{tool}_{group}.log")
        if args.dry_run:
            lines.append(f"{tool} {group}: {''.join(f'{k}={v} ' for k, v in env_add.items())}{' '.join(cmd)} > {log}")
            continue
        env = {**os.environ, **env_add}
        if caching:
            env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
        left = None if args.timeout is None else max(1.0, args.timeout - (time.time() - start))
        t0 = time.time()
        text, rc = run_killable(cmd, env, left)
        if rc is None:
            text += f"\n[sanitize.py: killed after {left:.0f} s, the rest of --timeout {args.timeout:g} s]\n"
        with open(log, "w") as f:
            f.write(text)
        r = parse_report(text)
        r.update(group=group, rc=rc, seconds=time.time() - t0, log=log)
        runs.append(r)
    if args.dry_run:
        return True, lines
    clean, head = tool_summary(tool, runs, args.fail_on)
    lines.append(head)
    for r in runs:
        summary = " ".join(r["summaries"]) or "no summary (the sanitizer or the driver crashed or timed out)"
        rc = r["rc"] if r["rc"] is not None else "timeout"
        slowest = sorted(r["case_seconds"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"    {r['group']}: {summary}; {r['driver_line'] or 'no DRIVER line'}; rc {rc}; "
                     f"{r['seconds']:.0f} s (slowest cases: {', '.join(f'{n} {t:.0f} s' for n, t in slowest) or '-'}); "
                     f"log {r['log']}")
        for f in r["failed_cases"][:5]:
            lines.append(f"        {f}")
        for label, blocks in (("ours", r["ours"]), ("elsewhere", r["others"])):
            seen = []
            for b in blocks:
                d = describe(b)
                if d not in seen:
                    seen.append(d)
            lines += [f"        {label}: {d}" for d in seen[:5]]
            if len(seen) > 5:
                lines.append(f"        {label}: ... {len(seen) - 5} more distinct findings in the log")
    return clean, lines


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)} (default all)")
    p.add_argument("--device", "--driver-device", dest="device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the kernels, under compute-sanitizer; cpu: every case on the CPU "
                   "implementations in this process, no sanitizer (a check of the cases themselves)")
    p.add_argument("--cases", default=None, metavar="REGEX",
                   help="only the cases whose name matches (searched); --list shows them")
    p.add_argument("--list", action="store_true", help="list the cases and the schema ops each drives, and exit")
    p.add_argument("--jobs", type=int, default=1, help="tools run at once (default 1); each tool is its own "
                   "sanitizer process on the same GPU")
    p.add_argument("--ms", default=DEFAULT_MS, help=f"M values of the row-wise scaled_mm sweep, one per dispatch "
                   f"bucket (default {DEFAULT_MS})")
    p.add_argument("--n", type=int, default=256, help="N of that sweep (multiple of 16, default 256)")
    p.add_argument("--k", type=int, default=512, help="K of that sweep (multiple of 16, default 512)")
    p.add_argument("--quick", action="store_true", help="fewer parametrizations per case, every op still driven "
                   "(racecheck's selection in scripts/gpu_run.sh)")
    p.add_argument("--quick-tools", default="", metavar="LIST",
                   help="comma list of tools that get --quick's selection (scripts/gpu_run.sh: racecheck, the "
                   "slowest)")
    p.add_argument("--sanitizer", default=os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer"),
                   help="the compute-sanitizer executable (default: $COMPUTE_SANITIZER, else from PATH, "
                   "$CUDA_HOME/bin or /usr/local/cuda/bin)")
    p.add_argument("--sanitizer-arg", action="append", default=[],
                   help="extra argument for compute-sanitizer (repeatable), e.g. --sanitizer-arg=--padding=64")
    p.add_argument("--python", default=sys.executable, help="interpreter for the driver (default: this one)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "sanitize_logs"),
                   help="where each tool's full reports go, <tool>_<eager|graphs>.log (default sanitize_logs/)")
    p.add_argument("--fail-on", choices=("any", "ours"), default="any",
                   help="exit 1 on any reported error (default) or only on errors attributed to our code")
    p.add_argument("--no-configs", action="store_true", help="force only the first config of each table")
    p.add_argument("--prefill-outputs", action="store_true",
                   help="(driver) host-written NaN outputs for GEMMs that may store by TMA; set for initcheck")
    p.add_argument("--group", choices=("eager", "graphs", "all"), default="all",
                   help="(driver) which cases: eager (no CUDA graphs), graphs, all (default)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the driver (repeatable), e.g. CUTLASS_W8A8_FORCE_ARCH=sm80 to run the "
                   "int8 work through the sm80 kernels on a Hopper GPU")
    p.add_argument("--keep-caching", action="store_true",
                   help="keep torch's caching allocator for the eager cases too (less precise bounds; faster)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per tool, its two driver processes together (default: none)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--driver", action="store_true", help="run the cases in this process (what the sanitizer "
                   "wraps)")
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.env):
        p.error("--env takes KEY=VALUE")
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in args.tools if t not in TOOLS]
    if bad or not args.tools:
        p.error(f"--tools: unknown {bad or 'empty list'}; choose from {', '.join(TOOLS)}")
    args.quick_tools = [t.strip() for t in args.quick_tools.split(",") if t.strip()]
    bad = [t for t in args.quick_tools if t not in TOOLS]
    if bad:
        p.error(f"--quick-tools: unknown {bad}; choose from {', '.join(TOOLS)}")
    try:
        args.ms = [int(v) for v in args.ms.split(",") if v.strip()]
    except ValueError:
        p.error("--ms must be a comma list of integers")
    if any(m < 0 for m in args.ms):
        p.error("--ms: M must be >= 0")
    for name in ("n", "k"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.cases:
        try:
            re.compile(args.cases)
        except re.error as exc:
            p.error(f"--cases: not a regular expression: {exc}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        return list_cases()
    if args.driver or args.device == "cpu":
        return driver(args)
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None and not args.dry_run:
        print(f"sanitize.py: compute-sanitizer not found ({args.sanitizer!r} is not on PATH, nor in $CUDA_HOME/bin or "
              "/usr/local/cuda/bin). It ships with the CUDA toolkit; pass --sanitizer PATH or set "
              "$COMPUTE_SANITIZER. Without it: --driver runs the CUDA cases unsanitized, --device cpu the CPU "
              "implementations.", file=sys.stderr)
        return 2
    args.sanitizer = sanitizer or args.sanitizer
    if not selected_groups(args.cases):
        print(f"sanitize.py: --cases {args.cases!r} matches no case (--list lists them)", file=sys.stderr)
        return 2
    if not args.dry_run:
        os.makedirs(args.log_dir, exist_ok=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_tool, tool, args): tool for tool in args.tools}
        for fut in concurrent.futures.as_completed(futures):
            tool = futures[fut]
            results[tool] = fut.result()
            print("\n".join(results[tool][1]), flush=True)
    if args.dry_run:
        return 0
    bad = [t for t in args.tools if not results[t][0]]
    print("\nsummary:")
    for t in args.tools:
        print("  " + results[t][1][0])
    print(f"tools clean: {len(args.tools) - len(bad)} of {len(args.tools)}" + (f"; failing: {', '.join(bad)}"
                                                                              if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
