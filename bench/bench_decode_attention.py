"""decode attention alone: the one-kernel path (a cluster per row) against the split + combine kernels (issue 36).

For each head layout (Qwen3-30B-A3B: 32 query / 4 key-value heads, Llama-3-8B: 32 / 8; D = 128, bfloat16), batch
and cache length, times `decode_attention` and `decode_attention_quant` (int8, dynamic per-token) with every row at
its last position (the whole cache read), on each path: "auto" (the fused path allowed through
cutlass_w8a8._ext.set_decode_attention_fused(True), off by default: the fused kernel where its rule lets it serve,
cutlass_w8a8._ext.decode_attention_path says which) and "split" (the fused path forbidden with
cutlass_w8a8._ext.set_decode_attention_fused(False)). Times are CUDA-graph replays over rotating inputs (cold L2,
cutlass_w8a8.testing.timers.bench_gpu_time), microseconds per call. Before timing, the two paths' outputs are
compared bit for bit (a mismatch is reported in the table and makes the exit status 1).

    python bench/bench_decode_attention.py                       # B 1, 8; S 512, 4096; PDL as configured
    python bench/bench_decode_attention.py --profile             # also each kernel's own time (torch.profiler)
    CUTLASS_W8A8_ATTN_SPLITS=ctas python bench/bench_decode_attention.py --json ctas.json    # CTAs-per-SM splits
    CUTLASS_W8A8_ATTN_MIN_CHUNK=32 python bench/bench_decode_attention.py --json c32.json   # another split size
    CUTLASS_W8A8_ATTN_SPLITS=ctas CUTLASS_W8A8_ATTN_CTAS_PER_SM=8 python bench/bench_decode_attention.py --json c8.json
    CUTLASS_W8A8_ATTN_PREFETCH=1 python bench/bench_decode_attention.py --json pf.json       # loads a step ahead
    CUTLASS_W8A8_ATTN_COMBINE=row python bench/bench_decode_attention.py --json row.json     # one-block combine
    CUTLASS_W8A8_ATTN_HEADS_PER_CTA=8 python bench/bench_decode_attention.py --layouts qwen3-30b-a3b \
        --batches 1,4,8,32 --seq 256,512,1024,4096,16384 --json h8.json                 # up to 8 heads per CTA

``--profile`` adds, per point, path and variant, the mean duration of each attention kernel (split, combine,
fused) over eager calls with PDL off (with PDL a kernel starts early and its griddepcontrol wait would count in its
duration), from torch.profiler's CUDA activities: where a call's time goes. The A/B knobs of
csrc/attention/decode_attention.cu are read once per process, so one process per value (the JSON records them, as
set: None when unset): CUTLASS_W8A8_ATTN_SPLITS=ctas picks the split count of the CTAs-per-SM rule in place of the
default wave rule's (the fewest waves of resident CTAs times positions per CTA), CUTLASS_W8A8_ATTN_MIN_CHUNK sets the
least positions per split, CUTLASS_W8A8_ATTN_CTAS_PER_SM the split CTAs per SM the ctas rule aims at (default 2; no
effect under the wave rule), CUTLASS_W8A8_ATTN_PREFETCH=1 makes the split step load its next step's K and V before
its math (the same bits at the same split count; the wave rule's count follows the variant's occupancy),
CUTLASS_W8A8_ATTN_COMBINE=row runs the one-block-per-row combine kernel where the cluster combine (8 blocks a row,
sm90) serves by default (the same bits), CUTLASS_W8A8_ATTN_HEADS_PER_CTA=1, 2, 4 or 8 caps the query heads per block
G' (default 4: the largest of 8, 4, 2, 1 dividing the GQA group and at most the cap; Qwen3-30B-A3B's 8 become 4, 8
at 8; Llama-3-8B's 4 stay; the same bits at the same split count, but the count follows the blocks, so it may change).
    python bench/bench_decode_attention.py --batches 1,2,4,8,16 --seq 512 --pdl off --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8 import _ext
from cutlass_w8a8.testing.attention import make_inputs
from cutlass_w8a8.testing.timers import (
    bench_gpu_time,
    cuda_kernel_times,
    l2_cache_bytes,
    rotating_arg_sets,
)

LAYOUTS = {"qwen3-30b-a3b": (32, 4), "llama-3-8b": (32, 8)}
OPS = torch.ops.cutlass_w8a8


#: The JSON key of each of the attention kernels' A/B knobs (environment variables read once per process).
KNOB_ENVS = {"min_chunk_env": "CUTLASS_W8A8_ATTN_MIN_CHUNK", "ctas_per_sm_env": "CUTLASS_W8A8_ATTN_CTAS_PER_SM",
             "prefetch_env": "CUTLASS_W8A8_ATTN_PREFETCH", "combine_env": "CUTLASS_W8A8_ATTN_COMBINE",
             "splits_env": "CUTLASS_W8A8_ATTN_SPLITS", "heads_per_cta_env": "CUTLASS_W8A8_ATTN_HEADS_PER_CTA"}


def _knob_envs() -> dict:
    """Each knob's value in this process's environment, as set (None when unset), under its JSON key."""
    return {key: os.environ.get(name) for key, name in KNOB_ENVS.items()}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _run(variant: str, softmax_scale: float):
    if variant == "plain":
        return lambda q, kv, slots, positions: OPS.decode_attention(q, kv, slots, positions, softmax_scale)
    return lambda q, kv, slots, positions: OPS.decode_attention_quant(q, kv, slots, positions, softmax_scale,
                                                                      torch.int8, None)


def _bits(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in outs]


def _kernel_tag(name: str) -> str:
    for tag in ("fused", "split", "combine"):
        if f"decode_attention_{tag}_" in name:  # the combine: decode_attention_combine(_cluster)_kernel
            return tag
    return ""


def _profile(fn, args, calls: int = 7) -> dict[str, float]:
    """Median over ``calls`` eager calls (PDL off) of each attention kernel's duration in us, by tag
    (testing/timers.py cuda_kernel_times: torch.profiler's CUDA activity of one call)."""
    previous = _ext.set_pdl(False)
    try:
        per_call = [cuda_kernel_times(lambda: fn(*args)) for _ in range(calls)]
    finally:
        _ext.set_pdl(previous)
    out: dict[str, list[float]] = {}
    for kernels in per_call:
        call: dict[str, float] = {}
        for name, us in kernels:
            tag = _kernel_tag(name)
            if tag:
                call[tag] = call.get(tag, 0.0) + us
        for tag, us in call.items():
            out.setdefault(tag, []).append(us)
    return {tag: round(statistics.median(v), 2) for tag, v in out.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    parser.add_argument("--batches", default="1,8", type=_ints)
    parser.add_argument("--seq", default="512,4096", type=_ints, help="cache lengths S (every row at S - 1)")
    parser.add_argument("--pdl", choices=("on", "off", "default"), default="default")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--profile", action="store_true",
                        help="also each attention kernel's mean duration (torch.profiler, eager, PDL off)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not _ext.cuda_ops_available():
        print("needs a CUDA device and the built extension", file=sys.stderr)
        return 2
    if args.pdl != "default":
        cw._ext.set_pdl(args.pdl == "on")
    dev = torch.cuda.current_device()
    d = 128
    rows, mismatches = [], 0
    previous = _ext.set_decode_attention_fused(True)
    try:
        for name in args.layouts.split(","):
            h, kvh = LAYOUTS[name]
            for s in args.seq:
                for b in args.batches:
                    q, kv, slots, positions = make_inputs(b, h, kvh, d, s, torch.bfloat16, "cuda", seed=b,
                                                          positions=[s - 1] * b)
                    arg_sets = rotating_arg_sets((q, kv, slots, positions), l2_cache_bytes())
                    _ext.set_decode_attention_fused(True)  # the path "auto" takes (the "split" mode turns it off)
                    path = _ext.decode_attention_path(dev, b, h, kvh, s, d, torch.bfloat16)
                    for variant in ("plain", "int8"):
                        fn = _run(variant, 1.0 / math.sqrt(d))
                        times, outs, kernels = {}, {}, {}
                        for mode in ("auto", "split"):
                            _ext.set_decode_attention_fused(mode == "auto")
                            outs[mode] = _bits(fn(q, kv, slots, positions))
                            times[mode] = bench_gpu_time(fn, arg_sets).median_ms * 1e3
                            if args.profile:
                                kernels[mode] = _profile(fn, (q, kv, slots, positions))
                        same = all(torch.equal(x, y) for x, y in zip(outs["auto"], outs["split"]))
                        mismatches += not same
                        kv_bytes = 2 * b * kvh * s * d * 2
                        rows.append({"layout": name, "B": b, "S": s, "variant": variant, "path": path,
                                     "auto_us": round(times["auto"], 2), "split_us": round(times["split"], 2),
                                     "speedup": round(times["split"] / times["auto"], 3), "bitwise_equal": same,
                                     "kv_mb": round(kv_bytes / 1e6, 3),
                                     **({"kernel_us": kernels} if args.profile else {})})
    finally:
        _ext.set_decode_attention_fused(previous)
    knobs = ", ".join(f"{name}={os.environ.get(name, '')!r}" for name in KNOB_ENVS.values())
    print(f"device: {torch.cuda.get_device_name(dev)}, PDL {'on' if _ext.pdl_enabled() else 'off'}, {knobs}")
    print("| layout | B | S | variant | path (auto) | auto us | split+combine us | speedup | equal | KV MB |")
    print("|---|---:|---:|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['B']} | {r['S']} | {r['variant']} | {r['path']} | {r['auto_us']} | "
              f"{r['split_us']} | {r['speedup']}x | {r['bitwise_equal']} | {r['kv_mb']} |")
    if args.profile:
        print("\nKernel durations, us per call (torch.profiler, eager, PDL off):\n")
        print("| layout | B | S | variant | mode | split | combine | fused | sum |")
        print("|---|---:|---:|---|---|---:|---:|---:|---:|")
        for r in rows:
            for mode, k in r["kernel_us"].items():
                cells = " | ".join(f"{k[t]:.2f}" if t in k else "–" for t in ("split", "combine", "fused"))
                print(f"| {r['layout']} | {r['B']} | {r['S']} | {r['variant']} | {mode} | {cells} | "
                      f"{sum(k.values()):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "pdl": _ext.pdl_enabled(),
                       **_knob_envs(), "rows": rows}, f, indent=1)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
