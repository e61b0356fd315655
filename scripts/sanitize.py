#!/usr/bin/env python3
"""Run every cutlass_w8a8 kernel under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

For each tool T this runs

    compute-sanitizer --tool T --error-exitcode 1 --print-limit 10000 python3 scripts/sanitize.py --driver ...

with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is its own cudaMalloc allocation and memcheck and
initcheck see exact bounds (inside torch's cached blocks an overrun into a neighbour is invisible). The driver
(--driver) calls, on small problems (N=256, K=512 by default):

- scaled_mm for one M per dispatch bucket (M = 1, 24, 48, 100, 512, 2048: buckets 0..5 of
  csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh), int8 and fp8, both output dtypes, with and without bias,
  per-tensor and per-token/per-channel scales, alternating the functional form and out=; plus M = 0, and one
  case with a, b and out as windows of wider buffers;
- _scaled_mm_config with every config of the tables forced (the tuning candidates too when the package was
  built with CUTLASS_W8A8_TUNE=1), int8 and fp8;
- quantize_per_token (every kernel variant: register-resident rows of 1..8 vectors per thread of 256 or 8 of
  512 threads, the looping
  fallback for long or unaligned rows) and quantize_per_tensor, to int8 and fp8, from bf16, f16 and f32;

and checks every result (float64 reference for the GEMMs, bit-exact CPU reference for the quantization), so
a run that is clean under the sanitizer is also correct. It prints "DRIVER OK" at the end. Its inputs are
drawn on the host and copied over. Under initcheck every GEMM gets a host-written NaN-filled output
(--prefill-outputs): initcheck does not count the sm90 epilogue's TMA stores as writes and reported each
later read of those outputs (H200, compute-sanitizer of CUDA 13.0); a skipped element stays NaN and fails
the check.

Per tool, this script prints the sanitizer's own summary line and its reading of the report:

    memcheck: ERROR SUMMARY: 0 errors  [ours: 0, elsewhere: 0; driver ok; rc 0; log sanitize_logs/memcheck.log]

"ours" are reports that name our kernels or libraries (cutlass, cutlass_w8a8, per_token/per_tensor kernels,
_C.so, _kernels_sm*.so); "elsewhere" are the rest (torch's own kernels and allocations, e.g. initcheck on
buffers torch leaves uninitialised). Exit status 1 when any tool reports errors (--fail-on ours: only ours),
when the driver fails, or when a tool gives no summary (crash, timeout).

Examples (GPU machine, repository root)::

    python scripts/sanitize.py                      # all four tools
    python scripts/sanitize.py --tools memcheck,synccheck --quick
    python scripts/sanitize.py --env CUTLASS_W8A8_FORCE_ARCH=sm80   # int8 through the sm80 kernels
    python scripts/sanitize.py --driver             # the driver alone, no sanitizer (a quick sanity run)
    python scripts/sanitize.py --dry-run            # print the commands
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# One M per bucket of select_config: [1, 16], (16, 32], (32, 64], (64, 128], (128, 1024], > 1024.
DEFAULT_MS = "1,24,48,100,512,2048"
# Substrings that mark a report as ours: kernel names (CUTLASS device_kernel<...>, cutlass_w8a8::...
# per_token_*_kernel / per_tensor_kernel) or host frames in our libraries.
OUR_MARKERS = ("cutlass", "cw8a8", "per_token", "per_tensor", "_kernels_sm", "_C.so")
# Lines of the report that are not findings.
_NOT_FINDINGS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                           r"Target application returned an error|Error: process didn't terminate|"
                           r"This application|Note:|No .* errors? found)", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------------
# the driver: runs under the sanitizer


def driver(args) -> int:
    import torch

    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing.references import fp8_accum_bound
    from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes

    dev = torch.device(args.driver_device)
    if dev.type == "cuda" and (not torch.cuda.is_available() or not cw.cuda_ops_available()):
        print(f"DRIVER FAILED: needs a GPU and the built extension ({cw.extension_status()})", flush=True)
        return 2

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # Every input is drawn on the host and copied to the device: initcheck counts a host-to-device copy as
    # initialisation, but it flagged 4656 reads of torch.randint's device output as uninitialised (torch 2.11,
    # compute-sanitizer 2025.3), which flooded the report and ran it past its time limit.
    g = torch.Generator().manual_seed(0)

    def on_dev(t):
        return t.to(dev)
    n, k = args.n, args.k
    calls = failures = 0

    def fail(what, exc):
        nonlocal failures
        failures += 1
        print(f"DRIVER MISMATCH {what}: {exc}", flush=True)

    def check_gemm(what, out, a, b, sa, sb, bias, dtype, out_dtype):
        ref = reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), None if bias is None else bias.cpu())
        rel = fp8_accum_bound(ref.k) if dtype == torch.float8_e4m3fn else 0.0
        assert_close_to_reference(out.cpu(), ref, out_dtype, accum_rel=rel, what=what)

    def gemm(m, dtype, out_dtype, bias_on, per_token, use_out, config=None, windowed=False):
        nonlocal calls
        calls += 1
        what = (f"scaled_mm M={m} N={n} K={k} {dtype} -> {out_dtype} bias={bias_on} per_token={per_token} "
                f"out={use_out} config={config} windowed={windowed}")
        a = on_dev(rand_operand((m, k), dtype, "cpu", g))
        w = on_dev(rand_operand((n, k), dtype, "cpu", g))
        if windowed:  # a, b and out as windows of wider buffers, 16-byte aligned
            a = on_dev(rand_operand((m, k + 48), dtype, "cpu", g))[:, 16:16 + k]
            w = on_dev(rand_operand((n, k + 32), dtype, "cpu", g))[:, 32:]
        ma, mb = scale_magnitudes(dtype, k)
        sa = on_dev(rand_scale((m, 1) if per_token else (1,), "cpu", ma, g))
        sb = on_dev(rand_scale((n,) if per_token else (1,), "cpu", mb, g))
        bias = on_dev((torch.randn(n, generator=g) * 4).to(out_dtype)) if bias_on else None
        out_buf = None
        try:
            if args.prefill_outputs and not windowed:
                # initcheck: an output the host wrote (NaN) first; any element the GEMM skips stays NaN and
                # fails the comparison below, and initcheck checks our kernels' reads
                out = on_dev(torch.full((m, n), float("nan"), dtype=out_dtype))
            elif windowed:
                out_buf = on_dev(torch.full((m, n + 24), 7.0, dtype=out_dtype))
                out = out_buf[:, 8:8 + n]
            elif config is not None or use_out:
                out = torch.empty(m, n, dtype=out_dtype, device=dev)  # uninitialised: initcheck's case
            else:
                out = None  # the op allocates it
            if out is None:
                out = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, bias)
            elif config is not None:
                torch.ops.cutlass_w8a8._scaled_mm_config(out, a, w.t(), sa, sb, bias, config)
            else:
                cw.scaled_mm(a, w.t(), sa, sb, bias=bias, out=out)
            sync()
            if m:
                check_gemm(what, out, a, w.t(), sa, sb, bias, dtype, out_dtype)
            if out_buf is not None:
                assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all(), "wrote outside out"
        except Exception as exc:  # noqa: BLE001
            fail(what, exc)

    dtypes = [torch.int8, torch.float8_e4m3fn]
    combos = [(od, b, pt) for od in (torch.bfloat16, torch.float16) for b in (False, True) for pt in (False, True)]
    if args.quick:
        combos = [(torch.bfloat16, False, False), (torch.float16, True, True)]
    for m in args.ms:
        for dtype in dtypes:
            for i, (out_dtype, bias_on, per_token) in enumerate(combos):
                gemm(m, dtype, out_dtype, bias_on, per_token, use_out=i % 2 == 1)
    for dtype in dtypes:
        gemm(0, dtype, torch.bfloat16, True, True, use_out=False)
        gemm(0, dtype, torch.bfloat16, True, True, use_out=True)
        gemm(100, dtype, torch.bfloat16, True, True, use_out=True, windowed=True)
    if not args.no_configs:  # every entry of the config tables forced (tuning candidates too, if built)
        for dtype in dtypes:
            for config in range(num_configs(dtype, dev)):
                gemm(100, dtype, torch.bfloat16, True, True, use_out=True, config=config)

    # quantization: every kernel variant (csrc/quant/quantize.cu): rows of K elements in 16-byte vectors,
    # 1, 2, 4 or 8 vectors per thread of a 256-thread block, 8 of a 512-thread block, the loop kernel beyond
    # that and for rows that are not vector-aligned; static per-tensor.
    quant = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}
    ks = (512, 4096, 8192, 16384, 32768, 40000, 100) if not args.quick else (512, 32768, 40000, 100)
    for qdtype, fn in quant.items():
        for xdtype in (torch.bfloat16, torch.float16, torch.float32):
            for kk in ks:
                xs = [on_dev((torch.randn(3, kk, generator=g) * 3).to(xdtype))]
                if kk == 512:  # padded rows (a slice of a wider buffer) and a transposed input
                    xs.append(on_dev((torch.randn(2, 576, generator=g) * 3).to(xdtype))[:, 64:])
                    xs.append(on_dev((torch.randn(512, 5, generator=g) * 3).to(xdtype)).t())
                for x in xs:
                    for static in (False, True):
                        calls += 1
                        what = f"quantize {xdtype} -> {qdtype} shape={tuple(x.shape)} static={static}"
                        try:
                            scale = on_dev(torch.tensor([0.05])) if static else None
                            q, s = fn(x, scale) if static else fn(x)
                            sync()
                            q_ref, s_ref = fn(x.cpu(), scale.cpu()) if static else fn(x.cpu())
                            assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), "q differs"
                            assert torch.equal(s.cpu(), s_ref), "scale differs"
                        except Exception as exc:  # noqa: BLE001
                            fail(what, exc)
    sync()
    if failures:
        print(f"DRIVER FAILED: {failures} of {calls} calls", flush=True)
        return 1
    print(f"DRIVER OK: {calls} calls checked", flush=True)
    return 0


def num_configs(dtype, dev) -> int:
    """Entries of the config table serving `dtype` on `dev`: read from the error of a config index far past
    the table ("`config` must be in [0, N)"), so it follows whichever kernel library the device uses."""
    import torch

    a = torch.zeros(1, 16, device=dev).to(dtype)
    b = torch.zeros(16, 16, device=dev).to(dtype).t()
    out = torch.empty(1, 16, dtype=torch.bfloat16, device=dev)
    one = torch.ones(1, device=dev)
    try:
        torch.ops.cutlass_w8a8._scaled_mm_config(out, a, b, one, one, None, 1 << 30)
    except ValueError as exc:
        m = re.search(r"must be in \[0, (\d+)\)", str(exc))
        if m:
            return int(m.group(1))
    return 0  # the CPU reference ignores the config: nothing to force


# ----------------------------------------------------------------------------------------------------
# reading the sanitizer's report


def parse_report(text: str) -> dict:
    """Summary lines, findings split into ours / elsewhere, and the driver's status, from a tool's output."""
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
    return dict(
        summaries=summaries,
        errors=int(m.group(1)) if m else None,
        ours=ours,
        others=others,
        driver_ok="DRIVER OK" in text,
        driver_line=next((ln for ln in text.splitlines() if ln.startswith("DRIVER ")), None),
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


def run_tool(tool: str, args, driver_cmd) -> bool:
    cmd = [args.sanitizer, "--tool", tool, "--error-exitcode", "1", "--print-limit", "10000"]
    # initcheck flagged every read of an sm90 GEMM's output (torch copying it to the host: 10,000 reports,
    # all at the output's addresses; the quantization kernels' outputs, written by plain stores, were clean),
    # so under initcheck the outputs are written by the host first and checked for NaN left behind.
    cmd += args.sanitizer_arg + driver_cmd + (["--prefill-outputs"] if tool == "initcheck" else [])
    extra = dict(kv.split("=", 1) for kv in args.env)
    if not args.keep_caching:
        extra["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env = {**os.environ, **extra}
    log = os.path.join(args.log_dir, f"{tool}.log")
    if args.dry_run:
        prefix = "".join(f"{k}={v} " for k, v in extra.items())
        print(f"{tool}: {prefix}{' '.join(cmd)} > {log}")
        return True
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout, cwd=ROOT)
        text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        text, rc = (out.decode(errors="replace") if isinstance(out, bytes) else out), None
    with open(log, "w") as f:
        f.write(text)
    r = parse_report(text)
    summary = " ".join(r["summaries"]) or "no summary (the sanitizer or the driver crashed or timed out)"
    driver_state = "driver ok" if r["driver_ok"] else f"driver FAILED ({r['driver_line'] or 'no status line'})"
    print(f"{tool}: {summary}  [ours: {len(r['ours'])}, elsewhere: {len(r['others'])}; {driver_state}; "
          f"rc {rc if rc is not None else 'timeout'}; {time.time() - t0:.0f} s; log {log}]", flush=True)
    for label, blocks in (("ours", r["ours"]), ("elsewhere", r["others"])):
        seen = []
        for b in blocks:
            d = describe(b)
            if d not in seen:
                seen.append(d)
        for d in seen[:5]:
            print(f"    {label}: {d}")
        if len(seen) > 5:
            print(f"    {label}: ... {len(seen) - 5} more distinct findings in the log")
    return tool_ok(r, args.fail_on)


def tool_ok(r: dict, fail_on: str) -> bool:
    """Clean: a summary was printed, the driver passed, and no error counts (any, or only ours)."""
    if not r["summaries"] or r["errors"] is None or not r["driver_ok"]:
        return False
    if fail_on == "ours":
        return not r["ours"]
    return r["errors"] == 0 and not r["ours"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)} (default all)")
    p.add_argument("--ms", default=DEFAULT_MS, help=f"M values, one per dispatch bucket (default {DEFAULT_MS})")
    p.add_argument("--n", type=int, default=256, help="N of the GEMMs (multiple of 16, default 256)")
    p.add_argument("--k", type=int, default=512, help="K of the GEMMs (multiple of 16, default 512)")
    p.add_argument("--quick", action="store_true", help="2 of the 8 (out dtype, bias, scales) combinations "
                   "per M and dtype, fewer quantization shapes")
    p.add_argument("--sanitizer", default=os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer"),
                   help="the compute-sanitizer executable (default from PATH or $COMPUTE_SANITIZER)")
    p.add_argument("--sanitizer-arg", action="append", default=[],
                   help="extra argument for compute-sanitizer (repeatable), e.g. --sanitizer-arg=--padding=64")
    p.add_argument("--python", default=sys.executable, help="interpreter for the driver (default: this one)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "sanitize_logs"),
                   help="where each tool's full report goes (default sanitize_logs/)")
    p.add_argument("--fail-on", choices=("any", "ours"), default="any",
                   help="exit 1 on any reported error (default) or only on errors attributed to our code")
    p.add_argument("--no-configs", action="store_true", help="skip forcing each config with _scaled_mm_config")
    p.add_argument("--prefill-outputs", action="store_true",
                   help="(driver) give every GEMM a host-written, NaN-filled output; set for initcheck, which "
                   "does not count the sm90 epilogue's TMA stores as writes")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the driver (repeatable), e.g. CUTLASS_W8A8_FORCE_ARCH=sm80 to run the "
                   "int8 work through the sm80 kernels on a Hopper GPU")
    p.add_argument("--keep-caching", action="store_true",
                   help="keep torch's caching allocator (less precise bounds; faster)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per tool (default: none)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--driver", action="store_true", help="run the driver in this process (what the sanitizer "
                   "wraps)")
    p.add_argument("--driver-device", default="cuda", help="device of the driver's tensors (cpu: a self-test "
                   "of the driver against the reference ops, no GPU needed)")
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.env):
        p.error("--env takes KEY=VALUE")
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in args.tools if t not in TOOLS]
    if bad or not args.tools:
        p.error(f"--tools: unknown {bad or 'empty list'}; choose from {', '.join(TOOLS)}")
    try:
        args.ms = [int(v) for v in args.ms.split(",") if v.strip()]
    except ValueError:
        p.error("--ms must be a comma list of integers")
    if any(m < 0 for m in args.ms):
        p.error("--ms: M must be >= 0")
    for name in ("n", "k"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.driver:
        return driver(args)
    if not args.dry_run and shutil.which(args.sanitizer) is None:
        print(f"{args.sanitizer} not found (set --sanitizer or $COMPUTE_SANITIZER)", file=sys.stderr)
        return 2
    if not args.dry_run:
        os.makedirs(args.log_dir, exist_ok=True)
    driver_cmd = [args.python, os.path.abspath(__file__), "--driver", "--ms", ",".join(map(str, args.ms)),
                  "--n", str(args.n), "--k", str(args.k)] + (["--quick"] if args.quick else []) + \
                 (["--no-configs"] if args.no_configs else [])
    results = {tool: run_tool(tool, args, driver_cmd) for tool in args.tools}
    if args.dry_run:
        return 0
    bad = [t for t, ok in results.items() if not ok]
    failing = f"; failing: {', '.join(bad)}" if bad else ""
    print(f"tools clean: {len(results) - len(bad)} of {len(results)}{failing}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
