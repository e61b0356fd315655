"""The router GEMM and the routing of a MoE layer at decode sizes: unfused (``F.linear`` in the logits dtype, then
``moe_route``: two kernels) against ``moe_router_route`` (one kernel), in CUDA graphs with a cold L2 (issue 36).

For each model's router dims and T (default 1, 8, 16), both are timed interleaved (testing/timers.py
``bench_gpu_time_interleaved``: many calls per graph replay over rotating copies of x and the router weight, so
the weight is read from HBM as in a decode step that cycles through the layers) and checked against each other:
the share of tokens whose experts are the same, and the largest relative weight difference on those tokens (the op
differs from cuBLAS only by the logits' summation order, ops/moe.py moe_router_route). ``moe_route`` alone on the
logits is timed in the same interleaving (the routing's share), and each row names the fused launch (the cluster's
CTAs x the H slices per 16-expert tile, ``cutlass_w8a8._ext.moe_router_route_plan``). Prints a markdown table and
writes ``moe_router_<device>.json`` to ``--out``.

Models (router dims, routing): qwen3-30b-a3b (E 128, H 2048, top-8, softmax, renormalized, bf16 logits),
deepseek-v3 (E 256, H 7168, top-8, sigmoid + correction bias, 8 groups keep 4, x2.5, float32 logits as
transformers' ``F.linear(x.float(), w.float())``), mixtral-8x7b (E 8, H 4096, top-2), olmoe (E 64, H 2048, top-8,
not renormalized), kimi-k2 (E 384, H 7168, top-8, sigmoid + bias, x2.827, float32 logits), glm-4.5 (E 160,
H 5120, top-8, sigmoid + bias, x2.5, float32 logits).

Example::

    python bench/bench_moe_router.py                       # every model, T = 1, 8, 16
    python bench/bench_moe_router.py --models qwen3-30b-a3b --tokens 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (E, H, top_k, moe_route keyword arguments, logits dtype (None: x's))
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 8, dict(renormalize=True), None),
    "deepseek-v3": (256, 7168, 8, dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True,
                                       scaling_factor=2.5), torch.float32),
    "mixtral-8x7b": (8, 4096, 2, dict(renormalize=True), None),
    "olmoe": (64, 2048, 8, dict(renormalize=False), None),
    "kimi-k2": (384, 7168, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.827), torch.float32),
    "glm-4.5": (160, 5120, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5), torch.float32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--tokens", default="1,8,16", help="comma-separated T (1..16)")
    p.add_argument("--replays", type=int, default=25)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"--models: unknown {bad}; known: {', '.join(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    return args


def router_plan(cw, dev, e, h):
    """moe_router_route's (cluster CTAs, H slices) for this router (cutlass_w8a8._ext.moe_router_route_plan), or
    (None, None) with a build that predates the op."""
    try:
        return cw._ext.moe_router_route_plan(dev.index or 0, e, h, torch.bfloat16)
    except (AttributeError, RuntimeError):
        return None, None


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_router: needs a CUDA device", file=sys.stderr)
        return 2
    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing import timers

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    l2 = timers.l2_cache_bytes(dev)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    for model in args.models:
        e, h, k, kw, ldt = MODELS[model]
        w = (torch.randn(e, h, generator=gen) / h**0.5).to(dev, torch.bfloat16)
        if kw.get("scoring") == "sigmoid":
            kw = {**kw, "correction_bias": (torch.randn(e, generator=gen) * 0.05).to(dev)}
        for t in args.tokens:
            x = torch.randn(t, h, generator=gen).to(dev, torch.bfloat16)

            def unfused(x, w):
                logits = F.linear(x, w) if ldt is None else F.linear(x.float(), w.float())
                return cw.moe_route(logits, k, **kw)

            def fused(x, w):
                return cw.moe_router_route(x, w, k, logits_dtype=ldt, **kw)

            uw, ui = unfused(x, w)
            fw, fi = fused(x, w)
            same = (ui == fi).all(dim=1)
            rel = ((fw - uw).abs() / uw.abs().clamp_min(1e-30))[same].max().item() if same.any() else float("nan")
            def route_only(logits):
                return cw.moe_route(logits, k, **kw)

            logits = F.linear(x, w) if ldt is None else F.linear(x.float(), w.float())
            sets = timers.rotating_arg_sets((x, w), l2)
            got = timers.bench_gpu_time_interleaved(
                {"unfused": (unfused, sets), "fused": (fused, sets),
                 "route": (route_only, timers.rotating_arg_sets((logits,), l2))}, replays=args.replays)
            u_us, f_us = got["unfused"].median_ms * 1e3, got["fused"].median_ms * 1e3
            r_us = got["route"].median_ms * 1e3
            ctas, slices = router_plan(cw, dev, e, h)
            rows.append(dict(model=model, tokens=t, experts=e, hidden=h, top_k=k, unfused_us=u_us, fused_us=f_us,
                             route_only_us=r_us, speedup=u_us / f_us, same_experts=float(same.float().mean().item()),
                             max_rel_weight_diff=rel, weight_bytes=w.numel() * w.element_size(), cluster_ctas=ctas,
                             h_slices=slices))
            print(f"{model} T={t}: unfused {u_us:.2f} us, fused {f_us:.2f} us ({u_us / f_us:.2f}x; {ctas} CTAs, "
                  f"{slices} slices), moe_route alone {r_us:.2f} us, same experts {rows[-1]['same_experts']:.3f}, "
                  f"max rel weight diff {rel:.2e}", flush=True)
    head = ("| model | T | E | H | unfused (linear + moe_route) us | moe_router_route us | speedup | CTAs x slices | "
            "moe_route alone us | same experts |")
    print("\n" + head + "\n|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['experts']} | {r['hidden']} | {r['unfused_us']:.2f} | "
              f"{r['fused_us']:.2f} | {r['speedup']:.2f}x | {r['cluster_ctas']} x {r['h_slices']} | "
              f"{r['route_only_us']:.2f} | {r['same_experts']:.3f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"moe_router_{timers.device_slug(name)}.json")
    commit, dirty = timers.git_commit(REPO_ROOT)
    with open(path, "w") as f:
        json.dump({"device": name, "git_commit": commit, "git_dirty": dirty, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
