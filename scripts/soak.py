#!/usr/bin/env python3
"""Soak test: thousands of CUDA-graph replays of a W8A8 MLP with fresh inputs, checked, with memory tracked.

A bfloat16 MLP ``Linear(d, hidden) -> SiLU -> Linear(hidden, d)`` (``--layers`` pairs of them in sequence) is
swapped to W8A8 with `cutlass_w8a8.quantize_` and captured with `cutlass_w8a8.graphs.CapturedGraph`, one graph
per batch size (``--batch-sizes``), all sharing one memory pool as a serving system's batch buckets do. Then,
for ``--replays`` replays, round-robin over the batch sizes:

- fresh random inputs are generated on the GPU and copied into the graph's static input (the graph's
  ``__call__``), and the graph is replayed;
- the same input goes through the eager model; the replay must equal it bit for bit (the same kernels on the
  same inputs). Mismatch flags are kept on the GPU and read every ``--sync-every`` replays, so the loop does
  not synchronise the host each replay;
- every ``--ref-every`` replays the replay's output is also checked against the float64 reference of the
  last layer (cutlass_w8a8/testing/references.py, `assert_close_to_reference`);
- ``torch.cuda.memory_allocated()`` is read at each synchronisation point, with nothing but the persistent
  buffers alive; its largest distance from the value after warm-up is the memory drift.

Prints ``replays: N, mismatches: K, memory drift: X bytes`` last; exit status 1 on any mismatch or on drift
above ``--max-drift`` (default 0 bytes).

Example (GPU machine, repository root)::

    python scripts/soak.py                       # 10,000 replays, int8
    python scripts/soak.py --dtype fp8 --replays 20000 --batch-sizes 1,8,64,512
"""

from __future__ import annotations

import argparse
import os
import sys
import time



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--replays", type=int, default=10_000, help="total graph replays (default 10000)")
    p.add_argument("--batch-sizes", default="1,32,256", help="M of each captured graph (default 1,32,256)")
    p.add_argument("--d", type=int, default=1024, help="model width (multiple of 16, default 1024)")
    p.add_argument("--hidden", type=int, default=4096, help="MLP hidden width (multiple of 16, default 4096)")
    p.add_argument("--layers", type=int, default=1, help="MLP blocks in sequence (default 1)")
    p.add_argument("--dtype", choices=("int8", "fp8"), default="int8", help="quantized dtype (default int8)")
    p.add_argument("--ref-every", type=int, default=1000, help="float64 reference check period (default 1000)")
    p.add_argument("--sync-every", type=int, default=500,
                   help="read mismatch flags and memory every this many replays (default 500)")
    p.add_argument("--max-drift", type=int, default=0, help="allowed memory drift in bytes (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda, i.e. the current one); cpu "
                   "runs the loop without graphs or memory tracking, a self-test of this script")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(v) for v in args.batch_sizes.split(",") if v.strip()]
    except ValueError:
        p.error("--batch-sizes must be a comma list of integers")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes: each M must be >= 1")
    for name in ("d", "hidden"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16")
    for name in ("replays", "ref_every", "sync_every", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from torch import nn

    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing.references import fp8_accum_bound
    from cutlass_w8a8.testing.references import assert_close_to_reference, reference

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    if on_gpu:
        if not torch.cuda.is_available() or not cw.cuda_ops_available():
            print(f"needs a GPU and the built extension ({cw.extension_status()})", file=sys.stderr)
            return 2
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        sync, allocated, reserved = torch.cuda.synchronize, torch.cuda.memory_allocated, torch.cuda.memory_reserved
        name = torch.cuda.get_device_name(dev)
    else:  # self-test of the loop: eager "replays", no memory tracking
        sync, allocated, reserved, name = (lambda d=None: None), (lambda d=None: 0), (lambda d=None: 0), "cpu"
    qdtype = torch.int8 if args.dtype == "int8" else torch.float8_e4m3fn

    torch.manual_seed(args.seed)
    blocks = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.d, args.hidden), nn.SiLU(), nn.Linear(args.hidden, args.d)]
    model = cw.quantize_(nn.Sequential(*blocks).to(dev, torch.bfloat16), cw.W8A8Config(dtype=qdtype))
    last = model[-1]
    print(f"device: {name}; model: {args.layers} x ({args.d} -> {args.hidden} -> "
          f"{args.d}) {args.dtype}; batch sizes {args.batch_sizes}", flush=True)

    def last_layer_reference(x):
        """float64 reference of the last layer, from the eager output of the layers before it."""
        h = model[:-1](x)
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(h, qdtype)
        return reference(q, last.weight.t(), s, last.weight_scale, last.bias)

    # Persistent buffers first, so that the memory baseline includes them.
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    sources = {m: torch.empty(m, args.d, device=dev, dtype=torch.bfloat16) for m in args.batch_sizes}
    flags = torch.zeros(args.replays, dtype=torch.int32, device=dev)  # mismatching elements per replay
    pool = torch.cuda.graph_pool_handle() if on_gpu else None
    graphs = {}
    for m in args.batch_sizes:
        sources[m].normal_(generator=gen)
        graphs[m] = cw.graphs.CapturedGraph(model, [sources[m]], pool=pool) if on_gpu else model
    sync(dev)

    def fresh_input(m):
        x = sources[m]
        x.normal_(generator=gen)
        x.mul_(1.0 + (torch.rand((), device=dev, generator=gen) * 4))  # vary the scale of the inputs too
        return x

    # Warm-up round: every graph and the eager path once, so lazy allocations happen before the baseline.
    for m in args.batch_sizes:
        x = fresh_input(m)
        graphs[m](x)
        model(x)
        del x
    warm_ref = last_layer_reference(fresh_input(max(args.batch_sizes)))  # the reference path's allocations too
    del warm_ref
    sync(dev)
    baseline = allocated(dev)
    reserved0 = reserved(dev)
    drift = reserved_drift = 0
    samples = 0
    ref_failures = []
    reported = 0
    mismatches = 0
    t0 = time.time()

    def checkpoint(done):
        nonlocal drift, reserved_drift, samples, reported, mismatches
        sync(dev)
        bad = (flags[:done] != 0).nonzero().flatten().tolist()
        for i in bad[reported:]:
            print(f"MISMATCH replay {i} (M={args.batch_sizes[i % len(args.batch_sizes)]}): "
                  f"{int(flags[i])} elements differ from the eager model", flush=True)
        reported = len(bad)
        mismatches = len(set(bad) | set(ref_failures))
        drift = max(drift, abs(allocated(dev) - baseline))
        reserved_drift = max(reserved_drift, abs(reserved(dev) - reserved0))
        samples += 1

    for i in range(args.replays):
        m = args.batch_sizes[i % len(args.batch_sizes)]
        x = fresh_input(m)
        out = graphs[m](x)
        eager = model(x)
        flags[i] = (out != eager).sum()
        del eager
        if (i + 1) % args.ref_every == 0:
            try:
                ref = last_layer_reference(x)
                accum_rel = fp8_accum_bound(ref.k) if args.dtype == "fp8" else 0.0
                assert_close_to_reference(out, ref, torch.bfloat16, accum_rel=accum_rel,
                                          what=f"replay {i} (M={m}) vs float64 reference")
                del ref  # the float64 reference must not stay alive into the memory samples
            except AssertionError as exc:
                ref_failures.append(i)
                print(f"MISMATCH {exc}", flush=True)
        if (i + 1) % args.sync_every == 0 or i + 1 == args.replays:
            checkpoint(i + 1)
            if (i + 1) % (args.sync_every * 4) == 0:
                print(f"... {i + 1} replays, {mismatches} mismatches, drift {drift} bytes, "
                      f"{(i + 1) / (time.time() - t0):.0f} replays/s", flush=True)

    elapsed = time.time() - t0
    print(f"{args.replays} replays in {elapsed:.1f} s ({args.replays / elapsed:.0f}/s, eager check included); "
          f"{args.replays // args.ref_every} float64 reference checks; memory sampled {samples} times; "
          f"allocated at baseline {baseline} bytes, reserved drift {reserved_drift} bytes")
    print(f"replays: {args.replays}, mismatches: {mismatches}, memory drift: {drift} bytes", flush=True)
    return 1 if mismatches or drift > args.max_drift else 0


if __name__ == "__main__":
    sys.exit(main())
