"""Part ``decode`` of bench/bench_moe.py (issue 36): the MoE layer at decode sizes, routing included, the fused decode
path (`cutlass_w8a8.ops.moe.moe_decode_experts`: 2 kernels after the routing at top_k >= 4, 3 below or with
``CUTLASS_W8A8_MOE_DECODE_PREP=1``) against the unfused chain
(``W8A8MoE.fused_decode = False``: moe_align, moe_permute_quant, two grouped GEMMs, silu_mul_quant, moe_unpermute)
and transformers' bf16 experts.

Models (``--models``, those of `DECODE_MODELS`): Qwen3-30B-A3B (E 128, H 2048, I 768, top-8), Mixtral-8x7B (E 8,
H 4096, I 14336, top-2) and DeepSeek-V3's routed experts (E 256, H 7168, I 2048, top-8; its router's sigmoid scoring
and grouped top-k are not used here: every model is routed by softmax top-k, the same one-kernel ``moe_route``).
T = 1, 2, 4, 8, 16 tokens (``--decode-tokens``). Methods per point, for each scheme (int8, fp8, block fp8,
``--decode-schemes``):

- ``<scheme>_fused``: ``cw.W8A8MoE.from_float`` of the bf16 experts, called as ``layer(x, router_logits)``
  (``moe_route`` then ``moe_decode_experts``);
- ``<scheme>_unfused``: the same layer with ``fused_decode = False`` (``moe_route`` then the six ops of the chain);
- ``hf_bf16``: transformers' ``Qwen3MoeExperts`` (``experts_implementation="grouped_mm"``) after the router of its
  sparse-MoE block (float32 softmax of the logits, top-k, renormalized, cast to bf16), the layer part's baseline.

Each input set (hidden states bf16 ``[T, H]``, router logits float32 ``[T, E]``) has its own routing, so the active
experts change from call to call; the sets rotate through CUDA-graph replays, the methods interleaved, medians
(`_moe_common.time_cases`). Before timing: fused equals unfused bit for bit (the op's contract; otherwise the run
aborts), and both are within `LAYER_REL_TOL` of transformers' bf16 experts.

Reported per point and method: time (us); the active experts' weight bytes (the experts some token is routed to,
w13 and w2 with their scales; bf16 for transformers) / time as a fraction of the read rate measured in the same run
(the whole layer's time, routing included: stricter than the GEMM alone); the CUDA kernels of one eager layer call
(torch.profiler; graphs not needed for a count); fused / unfused time (< 1: the fused path is faster); the fused
layer's path (``paths``: "two-kernel" / "three-kernel" from ``cutlass_w8a8._ext.moe_decode_path``, "chain" where the
layer does not take the decode path: above 64 pairs, or on the CPU).

Targets (issue 36): the layer at T = 1, Qwen3-30B-A3B dims, routing included, <= 20 us on H200 (<= 26 us on H100;
no bound on other devices); <= 6 kernels per layer call; the active weights streamed at >= 80% of the read rate at
every T <= 16 (judged on the fused path, per scheme; a fraction above 1 is INVALID).

bench/ is on sys.path when the script runs (``python bench/bench_moe.py --parts decode``); the tests load this file
by name. Writes ``moe_decode_<device>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.physical import judge, mark, physical_check, verdict
from cutlass_w8a8.testing.report import AccuracyError, save_figure

from _moe_common import checked_rel_err, short_error, sync, time_cases

DECODE_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
DECODE_TOKENS = (1, 2, 4, 8, 16)
QUICK_DECODE_TOKENS = (1, 8)
DECODE_SCHEMES = ("int8", "fp8", "block")
DECODE_SETS = (4, 32)  # rotating input sets per point: at least, at most (enough to exceed twice the L2)
OPTIONAL = frozenset({"hf_bf16"})
# issue 36's targets
TARGET_T1_MODEL = "qwen3-30b-a3b"
TARGET_T1_US = (("H200", 20.0), ("H100", 26.0))  # by device name; no bound on other devices
TARGET_KERNELS = 6
TARGET_READ_FRACTION = 0.8


def scheme_config(cw: Any, scheme: str):
    fp8 = torch.float8_e4m3fn
    return {"int8": cw.W8A8Config(dtype=torch.int8), "fp8": cw.W8A8Config(dtype=fp8),
            "block": cw.W8A8Config(dtype=fp8, weight_block_size=(128, 128))}[scheme]


def hf_layer(experts: torch.nn.Module, top_k: int, renormalize: bool) -> Callable:
    """transformers' sparse-MoE block without its gate: the router's float32 softmax of the logits, top-k,
    renormalized, cast to the hidden states' dtype, then ``experts(x, ids, weights)``."""
    def fn(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(p, top_k, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return experts(x, ids, w.to(x.dtype))
    return fn


def expert_bytes(mod: Optional[torch.nn.Module], h: int, inter: int) -> int:
    """Bytes one active expert's weights take: 8-bit w13 and w2 with their float32 scales (``mod`` a W8A8MoE), or
    bf16 ``gate_up_proj`` / ``down_proj`` (``mod`` None)."""
    if mod is None:
        return 3 * h * inter * 2
    return 3 * h * inter + 4 * (mod.w13_scale[0].numel() + mod.w2_scale[0].numel())


def active_experts(logits: torch.Tensor, top_k: int) -> int:
    """Experts some token is routed to: softmax top-k ranks the logits (host copy)."""
    return int(torch.unique(torch.topk(logits.float().cpu(), top_k, dim=-1).indices).numel())


def count_kernels(fn: Callable[[], Any], device: str) -> Optional[int]:
    """CUDA activities (kernels, and memsets / copies if any) of one eager call, from torch.profiler; None on the
    CPU or when the profiler records none (no CUPTI)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    n = sum(1 for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA)
    return n or None


def short_kernel_name(name: str) -> str:
    """A profiler kernel name without its namespaces, template arguments and parameters:
    ``void cutlass_w8a8::(anonymous namespace)::moe_decode_down_kernel<...>(...)`` -> ``moe_decode_down_kernel``;
    a name that is no function signature (``Memset (Device)``) as it is."""
    if not name.startswith("void "):
        return name
    head = name[len("void "):].replace("(anonymous namespace)::", "").split("<", 1)[0].split("(", 1)[0]
    return head.rsplit("::", 1)[-1].strip()


def kernel_durations(fn: Callable[[], Any], device: str) -> Optional[list]:
    """``[(short kernel name, us), ...]`` of one eager call in launch order, with PDL off (a PDL kernel starts early
    and its griddepcontrol wait would count in its duration; testing/timers.py cuda_kernel_times); None on the
    CPU."""
    if device != "cuda":
        return None
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.testing.timers import cuda_kernel_times

    previous = _ext.set_pdl(False)
    try:
        return [(short_kernel_name(n), round(us, 2)) for n, us in cuda_kernel_times(fn)]
    finally:
        _ext.set_pdl(previous)


def decode_path(cw: Any, mod: torch.nn.Module, t: int, top_k: int, device: str) -> str:
    """The kernels the fused layer ``mod`` (a `W8A8MoE`) runs after its routing at ``t`` tokens: ``"chain"`` where it
    does not take the decode path (`W8A8MoE.uses_decode_path`: above 64 pairs, or on the CPU), else
    ``cutlass_w8a8._ext.moe_decode_path``'s ``"two-kernel"`` / ``"three-kernel"`` (csrc/moe/moe_decode.cu own_quant,
    with this process's ``CUTLASS_W8A8_MOE_DECODE_PREP``)."""
    if not mod.uses_decode_path(torch.empty(t, mod.hidden_size, device=device), top_k):
        return "chain"
    return cw._ext.moe_decode_path(t, top_k, mod.hidden_size, mod.intermediate_size, mod.group_size)


def measure_decode_point(model: str, t: int, methods: dict, dims: tuple, args: argparse.Namespace, bu: Any,
                         l2_bytes: int, gen: torch.Generator, cgen: torch.Generator, device: str,
                         rel_tol: float) -> dict:
    """Check and time one (model, T) point: ``methods`` name -> (fn(x, logits), bytes per active expert)."""
    e, top_k, h, inter, _ = dims
    per_set = max(b for _, b in methods.values()) * min(e, t * top_k) + t * (h * 2 + e * 4)
    n_sets = max(2, min(bu.rotation_count(per_set, l2_bytes, int(args.rotate_gb * 2**30), DECODE_SETS[0]),
                        DECODE_SETS[1]))
    sets = [(torch.randn(t, h, generator=cgen, device=device).to(torch.bfloat16),
             2.0 * torch.randn(t, e, generator=gen).to(device)) for _ in range(n_sets)]
    errors: dict[str, str] = {}
    accuracy: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, (fn, _) in list(methods.items()):
        try:
            outs[name] = fn(*sets[0])
            sync(device)
        except Exception as exc:  # noqa: BLE001 (transformers' experts are optional)
            if name not in OPTIONAL:
                raise
            errors[name] = short_error(exc)
    for name in outs:
        if name.endswith("_fused"):
            unfused = name[:-len("_fused")] + "_unfused"
            if unfused in outs and not torch.equal(outs[name], outs[unfused]):
                raise AccuracyError(f"{model} decode T={t}: {name} differs from {unfused} (the fused decode path must "
                                    "equal the chain bit for bit)")
        if "hf_bf16" in outs and name != "hf_bf16":
            accuracy[name] = checked_rel_err(outs[name].float(), outs["hf_bf16"].float(), rel_tol,
                                             f"{model} decode T={t}: {name}", "transformers' bf16 experts")
    cases = {name: (fn, sets) for name, (fn, _) in methods.items() if name in outs}
    timings = time_cases(cases, errors, bu, args, OPTIONAL)
    times = {name: tm.median_ms for name, tm in timings.items()}
    active = sum(active_experts(lg, top_k) for _, lg in sets) / len(sets)
    kernels, kernel_us = {}, {}
    for name in times:
        try:
            kernels[name] = count_kernels(lambda fn=methods[name][0]: fn(*sets[0]), device)
            if name.endswith("_fused"):
                kernel_us[name] = kernel_durations(lambda fn=methods[name][0]: fn(*sets[0]), device)
        except Exception as exc:  # noqa: BLE001 (the profiler is a measurement aid)
            errors[f"{name} kernels"] = short_error(exc)
    return {"model": model, "T": t, "pairs": t * top_k, "E": e, "top_k": top_k, "H": h, "I": inter,
            "time_ms": times, "errors": errors, "rel_err_vs_hf_bf16": accuracy, "active_experts_mean": active,
            "active_weight_bytes_mean": {name: active * methods[name][1] for name in times},
            "kernels": kernels, "kernel_us": {k: v for k, v in kernel_us.items() if v is not None}, "sets": n_sets,
            "timing": {name: {"calls_per_replay": tm.calls_per_replay, "copies": tm.copies, "min_ms": tm.min_ms,
                              "max_ms": tm.max_ms} for name, tm in timings.items()}}


def run_decode(args: argparse.Namespace, cw: Any, bu: Any, results: dict, device: str, dims_of: dict,
               hf_experts: Callable, rel_tol: float) -> None:
    """The decode part into ``results["decode_points"]`` (one point per model and T)."""
    l2_bytes = bu.l2_cache_bytes()
    gen = torch.Generator().manual_seed(args.seed + 36)
    cgen = torch.Generator(device=device).manual_seed(args.seed + 36)
    for model in args.decode_models:
        e, top_k, h, inter, renorm = dims = dims_of[model]
        methods: dict[str, tuple] = {}
        try:
            base = hf_experts(e, top_k, h, inter, "grouped_mm", cgen)
            methods["hf_bf16"] = (hf_layer(base, top_k, renorm), expert_bytes(None, h, inter))
        except Exception as exc:  # noqa: BLE001 (no transformers, or its API moved: ours still runs)
            results.setdefault("decode_errors", {})[model] = short_error(exc)
            base = torch.nn.Module()
            base.gate_up_proj = torch.nn.Parameter((torch.randn(e, 2 * inter, h, generator=cgen, device=device)
                                                    * 0.02).to(torch.bfloat16), requires_grad=False)
            base.down_proj = torch.nn.Parameter((torch.randn(e, h, inter, generator=cgen, device=device)
                                                 * 0.02).to(torch.bfloat16), requires_grad=False)
        ours = {}
        for s in args.decode_schemes:
            fused = cw.W8A8MoE.from_float(base, scheme_config(cw, s), top_k, renorm)
            fused.fused_decode = True  # the decode path at every size here (the default picks it by I)
            unfused = copy.copy(fused)  # shares the buffers, its own fused_decode
            unfused.fused_decode = False
            ours[f"{s}_fused"] = (fused, expert_bytes(fused, h, inter))
            ours[f"{s}_unfused"] = (unfused, expert_bytes(fused, h, inter))
        methods = {**{n: ((lambda x, lg, m=m: m(x, lg)), b) for n, (m, b) in ours.items()}, **methods}
        for t in args.decode_tokens:
            p = measure_decode_point(model, t, methods, dims, args, bu, l2_bytes, gen, cgen, device, rel_tol)
            p["paths"] = {n: decode_path(cw, m, t, top_k, device) for n, (m, _) in ours.items() if n.endswith("_fused")}
            results["decode_points"].append(p)
            tm = p["time_ms"]
            print(f"  decode {model} T={t}: " + ", ".join(f"{m} {tm[m] * 1e3:.1f} us" for m in tm)
                  + ("" if not p["errors"] else f" (errors: {', '.join(p['errors'])})"), flush=True)
        del methods, ours, base
        if device == "cuda":
            torch.cuda.empty_cache()


# ---- derived numbers, targets, report ---------------------------------------------------------------------------


def t1_bound(device_name: str) -> Optional[float]:
    return next((us for key, us in TARGET_T1_US if key in (device_name or "")), None)


def derive_decode(results: dict[str, Any], schemes=DECODE_SCHEMES) -> None:
    """Per point ``derived`` (read fraction per method, fused / unfused per scheme) and ``results["targets"]``."""
    read = results.get("read_GBps_max")
    for p in results["decode_points"]:
        tm = p["time_ms"]
        d: dict[str, Any] = {}
        if read:
            for m, v in tm.items():
                d[f"{m}_read_fraction"] = p["active_weight_bytes_mean"][m] / (v * 1e-3) / 1e9 / read
        for s in schemes:
            f, u = tm.get(f"{s}_fused"), tm.get(f"{s}_unfused")
            d[f"{s}_fused_over_unfused"] = f / u if f and u else None
        p["derived"] = d
    items = []
    pts = results["decode_points"]
    bound = t1_bound(results.get("device", ""))
    for s in schemes:
        m = f"{s}_fused"
        p1 = next((p for p in pts if p["T"] == 1 and p["model"] == TARGET_T1_MODEL), None)
        v = p1["time_ms"].get(m) * 1e3 if p1 and m in p1["time_ms"] else None
        rf = p1["derived"].get(f"{m}_read_fraction") if p1 else None
        met, invalid = judge(None if v is None or bound is None else v <= bound,
                             physical_check(rf, 1.0, f"{m} {TARGET_T1_MODEL} T=1 read fraction"))
        items.append({"key": f"decode_{s}_T1_us", "issue": 36, "value": v, "bound": bound, "sense": "<=",
                      "label": f"MoE layer {TARGET_T1_MODEL} T=1, routing included, {m} (us, graphs; bound on "
                               f"{'/'.join(k for k, _ in TARGET_T1_US)} only)", "met": met, "invalid": invalid})
        counts = [p["kernels"].get(m) for p in pts if m in p["time_ms"]]
        worst = max(counts) if counts and None not in counts else None
        items.append({"key": f"decode_{s}_kernels", "issue": 36, "value": worst, "bound": TARGET_KERNELS,
                      "sense": "<=", "label": f"{m}: max CUDA kernels per layer call, routing included (profiler)",
                      "met": None if worst is None else worst <= TARGET_KERNELS, "invalid": None})
        fr = [(p["derived"].get(f"{m}_read_fraction"), p) for p in pts]
        fr = [(f, p) for f, p in fr if f is not None]
        lo = min(f for f, _ in fr) if fr else None
        met, invalid = judge(None if lo is None else lo >= TARGET_READ_FRACTION,
                             *(physical_check(f, 1.0, f"{m} {p['model']} T={p['T']} read fraction") for f, p in fr))
        items.append({"key": f"decode_{s}_read_fraction", "issue": 36, "value": lo, "bound": TARGET_READ_FRACTION,
                      "sense": ">=", "label": f"{m}: min over the models and T <= {max(DECODE_TOKENS)} of active "
                      "weight bytes / layer time / read rate", "met": met, "invalid": invalid})
    results["targets"] = {"items": items}


def _f(v: Optional[float], spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def render_decode_markdown(results: dict[str, Any]) -> str:
    schemes = results.get("decode_schemes", DECODE_SCHEMES)
    lines = [f"# MoE layer at decode sizes, fused vs unfused (issue 36): {results.get('device', '?')}", "",
             f"torch {results.get('torch_version')}, CUDA {results.get('cuda_version')}, commit "
             f"{results.get('git_commit')}{' (dirty)' if results.get('git_dirty') else ''}; transformers "
             f"{results.get('transformers_version', '–')}.",
             f"Read rate (x.amax over 1 GiB) {_f(results.get('read_GBps'), '.0f')} GB/s at the start, "
             f"{_f(results.get('read_GBps_end'), '.0f')} at the end. Timing: {results.get('timing', {}).get('method')}."
             " Every call routes its tokens (moe_route on float32 router logits; transformers: softmax, top-k).", "",
             "## Targets (issue 36)", "", "| target | value | bound | met |", "|---|---|---|---|"]
    for it in results.get("targets", {}).get("items", []):
        met = verdict(it["met"], it.get("invalid"), na="–")
        lines.append(f"| {it['label']} | {_f(it['value'])} | {it['sense']} {_f(it['bound'], 'g')} | {met} |")
    lines += ["", "## Per point", "",
              "Times in us (CUDA graphs, median); read % = active experts' weight bytes / time / read rate (the whole "
              "layer, routing included); kernels = CUDA activities of one eager call (profiler); fused / unfused "
              "< 1: the fused decode path is faster; path = the fused layer's kernels after the routing "
              "(cutlass_w8a8._ext.moe_decode_path: two-kernel or three-kernel; chain: the unfused chain).", ""]
    models: dict = {}
    for p in results["decode_points"]:
        models.setdefault(p["model"], []).append(p)
    for model, pts in models.items():
        p0 = pts[0]
        lines += [f"### {model} (E {p0['E']}, top-{p0['top_k']}, H {p0['H']}, I {p0['I']})", "",
                  "| T | method | time (us) | read % | kernels | fused / unfused | experts hit | path |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in pts:
            tm, d = p["time_ms"], p["derived"]
            for m in [f"{s}_{k}" for s in schemes for k in ("fused", "unfused")] + ["hf_bf16"]:
                if m not in tm and m not in p["errors"]:
                    continue
                us = _f(tm[m] * 1e3, ".1f") if m in tm else "did not run"
                rf = d.get(f"{m}_read_fraction")
                pct = mark(_f(None if rf is None else 100 * rf, ".0f"), physical_check(rf, 1.0, "read fraction"))
                ratio = _f(d.get(f"{m[:-len('_fused')]}_fused_over_unfused"), ".2f") if m.endswith("_fused") else ""
                path = (p.get("paths", {}).get(m) or "–") if m.endswith("_fused") else ""
                lines.append(f"| {p['T']} | {m} | {us} | {pct} | {_f(p['kernels'].get(m), 'd')} | {ratio} | "
                             f"{_f(p['active_experts_mean'], '.1f')} | {path} |")
        lines.append("")
    breakdown = [(p, m, ks) for p in results["decode_points"] for m, ks in p.get("kernel_us", {}).items() if ks]
    if breakdown:
        lines += ["## Kernel durations of the fused path", "",
                  "One eager layer call per point, PDL off (torch.profiler's CUDA activity), us per kernel in launch "
                  "order; the sum has no launch gaps, so it is below the graph time above.", "",
                  "| model | T | method | kernels (us) | sum |", "|---|---:|---|---|---:|"]
        for p, m, ks in breakdown:
            cells = ", ".join(f"{n} {us:.1f}" for n, us in ks)
            lines.append(f"| {p['model']} | {p['T']} | {m} | {cells} | {sum(us for _, us in ks):.1f} |")
        lines.append("")
    errs = [(p, m, msg) for p in results["decode_points"] for m, msg in p["errors"].items()]
    if errs or results.get("decode_errors"):
        lines += ["Did not run:", ""]
        lines += [f"- {m} ({p['model']} T={p['T']}): {msg}" for p, m, msg in errs]
        lines += [f"- {model}: {msg}" for model, msg in results.get("decode_errors", {}).items()]
        lines.append("")
    return "\n".join(lines)


def plot_decode(results: dict[str, Any], path: str) -> None:
    """One panel per model: time against T for each scheme's fused and unfused path and transformers' bf16."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models: dict = {}
    for p in results["decode_points"]:
        models.setdefault(p["model"], []).append(p)
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.5 * max(1, len(models)), 4.2), squeeze=False)
    for ax, (model, pts) in zip(axes[0], models.items()):
        names = sorted({m for p in pts for m in p["time_ms"]})
        for m in names:
            xs = [p["T"] for p in pts if m in p["time_ms"]]
            ys = [p["time_ms"][m] * 1e3 for p in pts if m in p["time_ms"]]
            ax.plot(xs, ys, marker="o", linestyle="--" if m.endswith("_unfused") else "-", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("us per layer call (routing included)")
        ax.set_title(model)
        ax.legend(fontsize=7)
    save_figure(fig, path, results.get("device", ""), dpi=110)
