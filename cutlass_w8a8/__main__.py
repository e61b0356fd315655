"""The main job, on a built-in default model: ``python -m cutlass_w8a8``.

Builds a small residual MLP stack in bfloat16 (random weights from a seed), quantizes a copy with
`quantize_`, captures both into CUDA graphs, replays them on fresh inputs, checks the W8A8 graph against
its eager run (bitwise) and against the float32 model (SQNR), and prints median timings: eager vs graph,
bf16 vs W8A8. Exits non-zero when a check fails.

Without a CUDA device (or with ``--cpu``) it is a correctness run on the ops' CPU reference implementations,
on a smaller default (2 blocks, hidden 256, MLP 896, batch 4): the W8A8 and bf16 models against the float32
one (SQNR), no CUDA graphs, and no timings measured or claimed.

Subcommands: ``python -m cutlass_w8a8 quantize SRC DST ...`` converts a Hugging Face checkpoint to a
compressed-tensors W8A8 one (`cutlass_w8a8.checkpoints.cli`; ``quantize --help`` says what reads the output per
scheme and model family, what it refuses and its exit statuses: 0 written, 1 cannot quantize or write, 2 refused).
"""

from __future__ import annotations

import argparse
import copy
import importlib
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


# ``python -m cutlass_w8a8 <name> ...`` runs ``main(argv)`` of the module, with the arguments after the name.
SUBCOMMANDS = {"quantize": "cutlass_w8a8.checkpoints.cli"}

# Default sizes: (GPU: Llama-3-8B's MLP; CPU: small enough for the reference ops to take a second).
GPU_DEFAULTS = {"batch": 16, "hidden": 4096, "ffn": 14336, "layers": 4}
CPU_DEFAULTS = {"batch": 4, "hidden": 256, "ffn": 896, "layers": 2}

# int8 per-token/per-channel over a few layers lands near 30 dB on random weights; fp8 (3 mantissa bits) near
# 25 dB. Below 20 dB something is broken, not merely imprecise.
SQNR_THRESHOLD_DB = 20.0


def run_subcommand(argv: list) -> int:
    """Dispatch ``argv = [name, *rest]`` to ``SUBCOMMANDS[name]``'s ``main(rest)`` (imported only now)."""
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return module.main(list(argv[1:]))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m cutlass_w8a8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g, c = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--batch", type=int, default=None,
                   help=f"tokens per step, M (default {g['batch']}; {c['batch']} on the CPU)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden size (default {g['hidden']}; {c['hidden']} on the CPU)")
    p.add_argument("--ffn", type=int, default=None,
                   help=f"MLP inner size (default {g['ffn']}, as Llama-3-8B; {c['ffn']} on the CPU)")
    p.add_argument("--layers", type=int, default=None, help=f"blocks (default {g['layers']}; {c['layers']} on the CPU)")
    p.add_argument("--dtype", choices=["int8", "fp8"], default="int8", help="quantized type (default int8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="the CPU correctness run even where a CUDA device is present (the default without one)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv)
    args = parse_args(argv)
    on_cpu = args.cpu or not torch.cuda.is_available()
    for key, value in (CPU_DEFAULTS if on_cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if on_cpu:
        return cpu_main(args)

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
        threshold = SQNR_THRESHOLD_DB
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


def cpu_main(args) -> int:
    """The correctness run on the CPU reference ops: W8A8 and bf16 against float32 (SQNR), no timings."""
    torch.manual_seed(args.seed)
    qdtype = torch.int8 if args.dtype == "int8" else torch.float8_e4m3fn
    reason = "--cpu" if torch.cuda.is_available() else "no CUDA device"
    print(f"CPU correctness run ({reason}): the ops run their CPU reference implementations; no CUDA graphs, "
          "no timings measured or claimed (the timed job needs a CUDA device and the built extension).")
    model_f32 = ResidualMLP(args.hidden, args.ffn, args.layers).eval()
    model_bf16 = copy.deepcopy(model_f32).to(torch.bfloat16)
    model_w8a8 = cw.quantize_(copy.deepcopy(model_bf16), cw.W8A8Config(dtype=qdtype))
    n_swapped = sum(isinstance(m, cw.W8A8Linear) for m in model_w8a8.modules())
    print(f"device: cpu; model: {args.layers} blocks, hidden {args.hidden}, ffn {args.ffn}; {n_swapped} linears "
          f"quantized to {args.dtype}; batch M = {args.batch}")
    ok = n_swapped == 2 * args.layers
    if not ok:
        print(f"FAIL: {n_swapped} linears quantized, expected {2 * args.layers} (hidden and ffn must be multiples "
              "of 16)")
    with torch.inference_mode():
        worst_sqnr, worst_bf16_sqnr = float("inf"), float("inf")
        for _ in range(5):  # fresh inputs each run
            x = torch.randn(args.batch, args.hidden, dtype=torch.bfloat16)
            y_f32 = model_f32(x.float())
            y_w8a8 = model_w8a8(x)
            if y_w8a8.shape != y_f32.shape or y_w8a8.dtype != torch.bfloat16 or not torch.isfinite(y_w8a8).all():
                print(f"FAIL: W8A8 output {tuple(y_w8a8.shape)} {y_w8a8.dtype}, finite: "
                      f"{bool(torch.isfinite(y_w8a8).all())}")
                ok = False
            worst_sqnr = min(worst_sqnr, sqnr_db(y_w8a8, y_f32))
            worst_bf16_sqnr = min(worst_bf16_sqnr, sqnr_db(model_bf16(x), y_f32))
    status = "ok" if worst_sqnr >= SQNR_THRESHOLD_DB else "FAIL"
    ok &= worst_sqnr >= SQNR_THRESHOLD_DB
    print(f"accuracy vs float32 model (SQNR, worst of 5 inputs): W8A8 {worst_sqnr:.1f} dB "
          f"[{status}, >= {SQNR_THRESHOLD_DB} dB], bf16 {worst_bf16_sqnr:.1f} dB")
    print("correctness run: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
