"""Per-kernel durations of one CUDA-graph decode step of the reference decoder (Llama-3-8B dims by default).

Prints, for each kernel name (template arguments dropped), the count in one step and the mean and total
duration (torch.profiler, CUDA activity), with PDL off (each kernel's own duration) and on (durations then
include the griddepcontrol wait). A diagnostic for csrc work: bench/bench_decoder.py has the classed table.

    python scripts/profile_step.py [--quant int8] [--batch 1] [--layers 32] [--position 256]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import capture
from cutlass_w8a8.models import LLAMA3_8B, LlamaDecoder


def short(name: str) -> str:
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:  # drop template arguments and parameter lists
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).replace("cutlass_w8a8::(anonymous namespace)::", "")[:90]


def profile(graph) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile as tprofile

    graph.replay()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[short(e.name)].append(e.time_range.elapsed_us())
    return kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", default="int8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--position", type=int, default=256)
    args = p.parse_args()
    cfg = LLAMA3_8B.replace(num_layers=args.layers)
    model = LlamaDecoder(cfg, quant=None if args.quant == "bf16" else args.quant, max_batch=args.batch,
                         max_seq_len=512, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (args.batch,), device="cuda")
    positions = torch.full((args.batch,), args.position, device="cuda", dtype=torch.long)
    print(f"{torch.cuda.get_device_name()}: {args.quant}, batch {args.batch}, {args.layers} layers, position "
          f"{args.position}")
    previous = cw.set_pdl(True)
    try:
        for pdl in (False, True):
            cw.set_pdl(pdl)
            graph, _ = capture(model, [tokens, positions])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(30):
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            kernels = profile(graph)
            times.sort()
            print(f"\nPDL {'on' if pdl else 'off'}: step {times[len(times) // 2]:.3f} ms (median of 30 replays); "
                  f"busy {sum(sum(v) for v in kernels.values()) / 1e3:.3f} ms")
            print(f"{'kernel':<90} {'n':>4} {'mean us':>8} {'total ms':>9}")
            for name, us in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
                print(f"{name:<90} {len(us):>4} {sum(us) / len(us):>8.2f} {sum(us) / 1e3:>9.3f}")
            del graph
    finally:
        cw.set_pdl(previous)


if __name__ == "__main__":
    main()
