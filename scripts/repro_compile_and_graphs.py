"""Reproduce (or rule out) the illegal memory access seen in bench_hf.py on an H100 when torch.compile
(mode="reduce-overhead") models and CUDA graphs of the package's decode step run interleaved in one process.

Each variant runs in its own subprocess (an illegal memory access poisons the CUDA context), with
CUDA_LAUNCH_BLOCKING=1, and prints one line: the variant, "ok" or the error and the Python frame that reported it.

  A  compiled transformers Llama steps only (control)
  B  A + the package's LlamaDecoder int8 step through DecodeGraphRunner (UpdatableGraph capture)
  C  A + rope_kv_cache_ and decode_attention alone, captured with cutlass_w8a8.graphs.capture
  D  A + a torch-only function (matmul + softmax) captured with cutlass_w8a8.graphs.capture (control for any capture)
  E  A + GraphGenerator(step="cw") decode steps of an optimized int8 copy of the same model

The probable cause is a captured cuBLAS GEMM (D's matmul; B's and E's bf16 lm_head) whose workspace is freed
by the graph trees' `_cuda_clearCublasWorkspaces()`. `cutlass_w8a8.graphs.capture` clears the workspaces around
each capture since f18b1cc, so with that fix every variant should print "ok". The script had not been run when
the fix was written.

Usage: python scripts/repro_compile_and_graphs.py [--layers 2] [--steps 150] [VARIANT ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback


def run_variant(name: str, layers: int, steps: int) -> None:
    import copy

    import torch
    import transformers

    import cutlass_w8a8 as cw
    from cutlass_w8a8.graphs import capture
    from cutlass_w8a8.models import LLAMA3_8B, LlamaDecoder
    from cutlass_w8a8.runner import DecodeGraphRunner

    torch.manual_seed(0)
    dev = "cuda"
    cfg = transformers.LlamaConfig(vocab_size=LLAMA3_8B.vocab_size, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=512, rope_theta=500000.0,
                                   attn_implementation="sdpa")
    with torch.device(dev):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    s = 256
    cache = transformers.StaticCache(config=cfg, max_cache_len=s)
    valid = torch.zeros((1, s), dtype=torch.bool, device=dev)
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), device=dev)
    compiled = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def prefill():
        cache.reset()
        valid.zero_()
        valid[:, :32] = True
        with torch.no_grad():
            hf(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def cstep(i):
        pos = torch.full((1, 1), 32 + i, dtype=torch.int64, device=dev)
        valid[:, 32 + i] = True
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return compiled(input_ids=prompt[:, i % 32:i % 32 + 1], past_key_values=cache, position_ids=pos,
                            use_cache=True, attention_mask=valid[:, None, None, :]).logits

    other = None
    if name == "B":
        dec = LlamaDecoder(LLAMA3_8B.replace(num_layers=layers), quant="int8", max_batch=1, max_seq_len=s,
                           device=dev)
        runner = DecodeGraphRunner(dec, max_batch=1, sizes=[1])
        slots = torch.zeros(1, dtype=torch.int64, device=dev)

        def other(i):
            return runner.step(prompt[:, i % 32], torch.full((1,), i % s, dtype=torch.int64, device=dev), slots)
    elif name == "C":
        kv = torch.randn(1, 2, 8, s, 128, device=dev, dtype=torch.bfloat16)
        qkv = torch.randn(1, 48, 128, device=dev, dtype=torch.bfloat16)
        rope = torch.randn(1, 64, 2, device=dev)
        slots = torch.zeros(1, dtype=torch.int64, device=dev)
        pos = torch.zeros(1, dtype=torch.int64, device=dev)

        def fn():
            cw.rope_kv_cache_(qkv, rope, kv, slots, pos, 32, 8)
            return cw.decode_attention(qkv[:, :32], kv, slots, pos)
        g, _ = capture(fn, ())

        def other(i):
            pos.fill_(i % s)
            g.replay()
    elif name == "D":
        x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        g, _ = capture(lambda: torch.softmax(x @ w, -1), ())

        def other(i):
            g.replay()
    elif name == "E":
        opt = cw.optimize_(cw.quantize_(copy.deepcopy(hf), cw.W8A8Config(dtype=torch.int8),
                                        filter_fn=lambda m, fqn: "lm_head" not in fqn))
        gen = cw.hf.GraphGenerator(opt, max_cache_len=s, sizes=[1], step="cw")
        assert gen.step == "cw"
        gen.prefill(prompt)

        def other(i):
            if i % 100 == 0:
                gen.prefill(prompt)
            return gen.decode(prompt[:, i % 32])
    where = "setup"
    try:
        for rep in range(3):
            where = f"rep {rep} prefill"
            prefill()
            for i in range(steps // 3):
                where = f"rep {rep} compiled step {i}"
                cstep(i)
                if other is not None:
                    where = f"rep {rep} {name} step {i}"
                    other(i)
        torch.cuda.synchronize()
        print(f"{name}: ok", flush=True)
    except Exception as exc:  # noqa: BLE001
        tb = traceback.extract_tb(exc.__traceback__)
        print(f"{name}: {type(exc).__name__} at {where}: {str(exc).splitlines()[0]}; frames: "
              + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in tb[-4:]), flush=True)
        sys.exit(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="*", default=["A", "B", "C", "D", "E"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=120, help="seconds per variant")
    args = p.parse_args()
    if args.one:
        run_variant(args.variants[0], args.layers, args.steps)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for v in args.variants:
        cmd = [sys.executable, __file__, "--one", "--layers", str(args.layers), "--steps", str(args.steps), v]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"{v}:")]
            print(lines[-1] if lines else f"{v}: rc={r.returncode}, no result line; stderr tail: "
                  + " | ".join(r.stderr.strip().splitlines()[-3:]), flush=True)
        except subprocess.TimeoutExpired:
            print(f"{v}: timed out after {args.timeout} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
