"""The main job, on a built-in default model: ``python -m cutlass_w8a8``.

Builds a small residual MLP stack in bfloat16 (random weights from a seed), quantizes a copy with
`quantize_`, captures both into CUDA graphs, replays them on fresh inputs, checks the W8A8 graph against
its eager run (bitwise) and against the float32 model (SQNR), and prints median timings: eager vs graph,
bf16 vs W8A8. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
from torch import nn

import cutlass_w8a8 as cw


class ResidualMLP(nn.Module):
    """``layers`` blocks of ``x + down(silu(up(norm(x))))``; ``up``: hidden -> ffn, ``down``: ffn -> hidden."""

    def __init__(self, hidden: int, ffn: int, layers: int):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(hidden, ffn, bias=False) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(ffn, hidden, bias=False) for _ in range(layers))

    def forward(self, x):
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.nn.functional.silu(up(norm(x))))
        return x


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10 log10(|ref|^2 / |x - ref|^2), in dB (torchao's accuracy metric)."""
    ref, x = ref.float(), x.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum().clamp_min(1e-30)))


def median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median over `iters` calls of fn(), each timed with CUDA events, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutlass_w8a8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="tokens per step, M (default 16)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--ffn", type=int, default=14336, help="MLP inner size (default 14336, as Llama-3-8B)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    p.add_argument("--dtype", choices=["int8", "fp8"], default="int8", help="quantized type (default int8)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("python -m cutlass_w8a8 needs a CUDA device", file=sys.stderr)
        return 2
    if not cw.cuda_ops_available():
        print(f"the CUDA extension is not built: {cw.extension_status()}", file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)
    qdtype = torch.int8 if args.dtype == "int8" else torch.float8_e4m3fn
    model_f32 = ResidualMLP(args.hidden, args.ffn, args.layers).cuda().eval()
    model_bf16 = copy.deepcopy(model_f32).to(torch.bfloat16)
    model_w8a8 = cw.quantize_(copy.deepcopy(model_bf16), cw.W8A8Config(dtype=qdtype))
    n_swapped = sum(isinstance(m, cw.W8A8Linear) for m in model_w8a8.modules())
    print(f"device: {torch.cuda.get_device_name()}; model: {args.layers} blocks, hidden {args.hidden}, "
          f"ffn {args.ffn}; {n_swapped} linears quantized to {args.dtype}; batch M = {args.batch}")

    def make_input():
        return torch.randn(args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)

    ok = True
    with torch.inference_mode():
        g_bf16 = cw.graphs.CapturedGraph(model_bf16, [make_input()])
        g_w8a8 = cw.graphs.CapturedGraph(model_w8a8, [make_input()])
        worst_sqnr, worst_bf16_sqnr = float("inf"), float("inf")
        for i in range(5):  # fresh inputs each replay
            x = make_input()
            y_graph = g_w8a8(x).clone()
            y_eager = model_w8a8(x)
            y_f32 = model_f32(x.float())
            if not torch.equal(y_graph, y_eager):
                print(f"FAIL: replay {i}: W8A8 graph output differs from eager")
                ok = False
            worst_sqnr = min(worst_sqnr, sqnr_db(y_graph, y_f32))
            worst_bf16_sqnr = min(worst_bf16_sqnr, sqnr_db(g_bf16(x), y_f32))
        # int8 per-token/per-channel over a few layers lands near 30 dB on random weights; fp8 (3 mantissa
        # bits) near 25 dB. Below 20 dB something is broken, not merely imprecise.
        threshold = 20.0
        status = "ok" if worst_sqnr >= threshold else "FAIL"
        ok &= worst_sqnr >= threshold
        print(f"accuracy vs float32 model (SQNR, worst of 5 replays): W8A8 graph {worst_sqnr:.1f} dB "
              f"[{status}, >= {threshold} dB], bf16 graph {worst_bf16_sqnr:.1f} dB")
        print(f"W8A8 graph replay == W8A8 eager (bitwise) on every replay: {'yes' if ok else 'NO'}")

        x = make_input()
        g_bf16.static_inputs[0].copy_(x)
        g_w8a8.static_inputs[0].copy_(x)
        t = {
            "bf16 eager": median_ms(lambda: model_bf16(x)),
            "bf16 graph": median_ms(g_bf16.graph.replay),
            "W8A8 eager": median_ms(lambda: model_w8a8(x)),
            "W8A8 graph": median_ms(g_w8a8.graph.replay),
        }
    print("\n| run | median ms | vs bf16 eager |")
    print("|---|---|---|")
    for name, ms in t.items():
        print(f"| {name} | {ms:.4f} | {t['bf16 eager'] / ms:.2f}x |")
    print(f"\nW8A8 graph over bf16 graph: {t['bf16 graph'] / t['W8A8 graph']:.2f}x; "
          f"W8A8 graph over W8A8 eager: {t['W8A8 eager'] / t['W8A8 graph']:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
