"""Part ``block`` of bench/bench_moe.py (issue 35): the whole MoE block of DeepSeek-V3 and GLM-4.5-Air, routing and
shared expert included, ours against transformers' bf16 block, in CUDA graphs.

The models (`BLOCK_MODELS`), their dims from transformers' config classes, whose defaults are these checkpoints':

- ``deepseek-v3``: ``DeepseekV3Config`` (hidden 7168, 256 routed experts of 2048, top-8, ``n_group`` 8,
  ``topk_group`` 4, ``routed_scaling_factor`` 2.5, ``norm_topk_prob``, one shared expert of 2048), block
  ``DeepseekV3MoE``. Kimi-K2 and DeepSeek-R1 / V3.1 have the same block.
- ``glm-4.5-air``: ``Glm4MoeConfig`` (hidden 4096, 128 routed experts of 1408, top-8, ``n_group`` 1, ``topk_group``
  1, ``routed_scaling_factor`` 1.0, ``norm_topk_prob``, one shared expert of 1408; the config's docstring calls its
  defaults "GLM-4-MOE-100B-A10B style"; the values come from `cutlass_w8a8.testing.model_dims.GLM_45_AIR`, which
  bench/bench_hf.py's ``--config glm-4.5-air`` shares), block ``Glm4MoeMoE``. The same dims are in NVIDIA Megatron-Bridge's
  GLM-4.5-Air page (https://docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/glm45.html: 4096 hidden,
  128 experts, top-8, 1.0x scaling, MoE FFN 1408, shared expert 1408).

Both blocks route the same way: ``logits = F.linear(x.float(), gate.weight.float())`` (float32), sigmoid scores,
``e_score_correction_bias`` added for the choice only, the best ``topk_group`` of ``n_group`` groups by the sum of
their top-2 biased scores, top-k inside them, the weights from the unbiased scores renormalized and multiplied by
``routed_scaling_factor``; then the experts, plus the shared expert (a SwiGLU MLP) on every token.

Methods of a point (`block_methods`):

- ``hf_block``: transformers' block built from its config class on the GPU, experts bf16 with
  ``experts_implementation="grouped_mm"`` (torch._grouped_mm, capturable), the shared expert bf16 ``nn.Linear``s, the
  router's weight and correction bias float32 (transformers 5.24 keeps both in float32; 5.17 keeps the bias, and
  casts the weight to float32 in the router: the weight holds bf16 values here, so both compute the same). Random
  weights (std 0.02), random correction bias (std `BIAS_STD`).
- ``ours_<scheme>`` (scheme ``int8`` per-channel, ``fp8`` per-channel, ``block`` 128 x 128 block fp8: the
  checkpoints' format): the same float32 router logits (the same F.linear on the same weight), then the routed
  experts as a `W8A8MoE` with the block's routing (``scoring="sigmoid"``, ``correction_bias``, ``n_group``,
  ``topk_group``, ``renormalize``, ``scaling_factor``) in router-logits mode, ``layer(x, logits)``: its `route`
  is ``moe_route`` (one kernel), then the experts' chain; plus the shared expert as two `W8A8Linear` (gate|up
  fused, then ``silu_mul_quant`` into down, as ``optimize_`` runs a SwiGLU MLP).
- ``ours_<scheme>_fused``: the same routing (``layer.route(logits)``), then the shared expert as expert E of a
  `W8A8MoE` of E + 1 experts, every token routed to it with weight 1.0 (ids / weights extended by one column in the
  graph): one grouped GEMM pair for both. The issue asks which is faster; the report says it per T.

The routed experts' quantized weights are shared by ``ours_<scheme>`` and ``ours_<scheme>_fused`` (views of the first
E experts of the E + 1), quantized on the device by `cutlass_w8a8.moe.quantize_expert_weights` (what
`W8A8MoE.from_float` runs) a few experts at a time, so that DeepSeek-V3's 256 experts (22.5 GB of bf16) take seconds
and no full float32 copy.

Before timing, on the first input set: our routing against transformers' router (the fraction of tokens whose
chosen experts differ must be at most `ROUTE_MISMATCH_MAX`: the op is bit-exact with it, and only an exact float32
tie may choose otherwise) and every ours' output against transformers' bf16 block (relative error below
``rel_tol``, the experts layer's bound: the block's output is a sum of expert outputs each with the same 8-bit
error, plus the shared expert's, which the sum does not grow).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from cutlass_w8a8.testing.model_dims import GLM_45_AIR as _GLM
from cutlass_w8a8.testing.report import AccuracyError
from cutlass_w8a8.testing.timers import tensor_bytes

from _moe_common import checked_rel_err, short_error, sync, time_cases, time_eager


@dataclasses.dataclass(frozen=True)
class BlockModel:
    """One MoE block: transformers' config and block classes (``transformers.models.<module>``) and its dims."""

    config: str
    module: str
    block: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    n_group: int
    topk_group: int
    scaling: float
    shared: int
    renormalize: bool = True


BLOCK_MODELS = {
    "deepseek-v3": BlockModel("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", 256, 8, 7168, 2048, 8, 4, 2.5, 1),
    # GLM-4.5-Air's block dims from their one owner, cutlass_w8a8.testing.model_dims (also bench_hf's --config)
    "glm-4.5-air": BlockModel("Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE", _GLM["n_routed_experts"],
                              _GLM["num_experts_per_tok"], _GLM["hidden_size"], _GLM["moe_intermediate_size"],
                              _GLM["n_group"], _GLM["topk_group"], _GLM["routed_scaling_factor"],
                              _GLM["n_shared_experts"], _GLM["norm_topk_prob"]),
}
SCHEMES = ("int8", "fp8", "block")
OURS_BLOCK = tuple(f"ours_{s}{v}" for s in SCHEMES for v in ("", "_fused"))
BLOCK_OPTIONAL = frozenset({"hf_block", "ours_block", "ours_block_fused"})
BLOCK_SETS = 8          # rotating input sets of a point (each its own hidden states, so its own routing)
BIAS_STD = 0.02         # the random e_score_correction_bias
ROUTE_MISMATCH_MAX = 0.01
QUANT_CHUNK = 32        # experts quantized at a time


def scheme_config(cw: Any, scheme: str):
    """The `W8A8Config` of a scheme: ``int8`` / ``fp8`` per-channel weights and per-token activations, ``block``
    e4m3 per 128 x 128 weight block and 1 x 128 activation group."""
    if scheme == "int8":
        return cw.W8A8Config(dtype=torch.int8)
    if scheme == "fp8":
        return cw.W8A8Config(dtype=torch.float8_e4m3fn)
    return cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))


def hf_block(spec: BlockModel, device: str, gen: torch.Generator) -> nn.Module:
    """transformers' block (``spec.block``) built from ``spec.config`` on ``device``: experts and shared expert bf16
    (random, std 0.02, from ``gen``), experts_implementation ``grouped_mm``; router weight float32 holding bf16
    values, correction bias float32 (std `BIAS_STD`). Allocated on the device directly (built on the meta device,
    cast, then ``to_empty``), filled in place."""
    import importlib

    import transformers

    cfg_cls = getattr(transformers, spec.config)
    block_cls = getattr(importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}"),
                        spec.block)
    cfg = cfg_cls(hidden_size=spec.hidden, moe_intermediate_size=spec.intermediate, n_routed_experts=spec.experts,
                  num_experts_per_tok=spec.top_k, n_group=spec.n_group, topk_group=spec.topk_group,
                  routed_scaling_factor=spec.scaling, n_shared_experts=spec.shared, norm_topk_prob=spec.renormalize,
                  hidden_act="silu", num_hidden_layers=1)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        block = block_cls(cfg)
    block = block.to(torch.bfloat16)
    block.gate.to(torch.float32)
    block = block.to_empty(device=device).requires_grad_(False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        block.gate.weight.copy_(block.gate.weight.to(torch.bfloat16))  # a bf16 checkpoint's values
        block.gate.e_score_correction_bias.normal_(0.0, BIAS_STD, generator=gen)
    return block.eval()


class SharedSwiGLU(nn.Module):
    """A shared expert as W8A8 layers: ``down(silu_mul_quant(gate_up(x)))``, ``gate_up`` the fused ``[gate; up]``
    `W8A8Linear` (N = 2I), ``down`` a `W8A8Linear` fed its quantized input (`QuantizedActivation`)."""

    def __init__(self, cw: Any, mlp: nn.Module, config):
        super().__init__()
        self._cw = cw
        gate_up = nn.Linear(mlp.gate_proj.in_features, 2 * mlp.gate_proj.out_features, bias=False, device="meta")
        gate_up.weight = nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), requires_grad=False)
        self.gate_up = cw.W8A8Linear.from_float(gate_up, config)
        self.down = cw.W8A8Linear.from_float(mlp.down_proj, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down
        q, s = self._cw.silu_mul_quant(self.gate_up(x), down.quant_dtype, down.input_scale, down.group_size)
        return down(self._cw.QuantizedActivation(q, s))


class OursBlock(nn.Module):
    """Our MoE block: transformers' float32 router logits, then ``routed`` (a `W8A8MoE` holding the block's routing)
    in router-logits mode plus ``shared`` (a `SharedSwiGLU`); or, given ``fused`` (a `W8A8MoE` of E + 1 experts,
    the shared expert last), ``routed.route`` then ``fused`` with every token also routed to expert E, weight 1.0."""

    def __init__(self, gate_weight: torch.Tensor, routed: nn.Module, shared: Optional[nn.Module] = None,
                 fused: Optional[nn.Module] = None):
        super().__init__()
        if (shared is None) == (fused is None):
            raise ValueError("OursBlock: give the shared expert either as `shared` or inside `fused`")
        self.gate_weight = gate_weight
        self.routed, self.shared, self.fused = routed, shared, fused

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.gate_weight)  # transformers' router: a float32 GEMM

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights float32 [T, k], ids int32 [T, k])`` of hidden states ``x`` ``[T, H]``."""
        return self.routed.route(self.logits(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        if self.fused is None:
            return self.routed(x, logits) + self.shared(x)
        w, ids = self.routed.route(logits)
        ids = F.pad(ids, (0, 1), value=self.routed.num_experts)
        w = F.pad(w, (0, 1), value=1.0)
        return self.fused(x, ids, w)


def build_ours(cw: Any, block: nn.Module, spec: BlockModel, scheme: str) -> dict[str, OursBlock]:
    """``{"ours_<scheme>": separate shared expert, "ours_<scheme>_fused": shared expert as expert E}`` of
    transformers' ``block``, the routed experts' 8-bit weights shared by both."""
    cfg = scheme_config(cw, scheme)
    qx = cw.moe.quantize_expert_weights
    e, h, i = spec.experts, spec.hidden, spec.intermediate
    dev = block.experts.gate_up_proj.device
    fused = cw.W8A8MoE(e + 1, spec.top_k + 1, h, i, cfg, renormalize=False, device=dev)
    sh = block.shared_experts
    with torch.no_grad():
        for lo in range(0, e, QUANT_CHUNK):
            hi = min(e, lo + QUANT_CHUNK)
            for name, w in (("w13", block.experts.gate_up_proj), ("w2", block.experts.down_proj)):
                q, s = qx(w[lo:hi], cfg.dtype, cfg.weight_block_size)
                getattr(fused, name)[lo:hi].copy_(q)
                getattr(fused, f"{name}_scale")[lo:hi].copy_(s)
        for name, w in (("w13", torch.cat([sh.gate_proj.weight, sh.up_proj.weight])), ("w2", sh.down_proj.weight)):
            q, s = qx(w[None], cfg.dtype, cfg.weight_block_size)
            getattr(fused, name)[e:].copy_(q)
            getattr(fused, f"{name}_scale")[e:].copy_(s)
    gate = block.gate
    routed = cw.W8A8MoE(e, spec.top_k, h, i, cfg, renormalize=spec.renormalize, device="meta", scoring="sigmoid",
                        n_group=spec.n_group, topk_group=spec.topk_group, scaling_factor=spec.scaling,
                        correction_bias=gate.e_score_correction_bias)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        setattr(routed, name, getattr(fused, name)[:e])
    routed.correction_bias = gate.e_score_correction_bias  # the router's tensor (the meta build made a meta copy)
    return {f"ours_{scheme}": OursBlock(gate.weight, routed, shared=SharedSwiGLU(cw, sh, cfg)),
            f"ours_{scheme}_fused": OursBlock(gate.weight, routed, fused=fused)}


def expert_bytes(mod: nn.Module) -> int:
    """Bytes of one expert's weights and scales: our `OursBlock`'s (``w13``, ``w2`` and their scales) or
    transformers' block's (``gate_up_proj`` and ``down_proj``)."""
    if isinstance(mod, OursBlock):
        x = mod.routed
        return sum(tensor_bytes(getattr(x, n)[0]) for n in ("w13", "w2", "w13_scale", "w2_scale"))
    return sum(tensor_bytes(p[0]) for p in (mod.experts.gate_up_proj, mod.experts.down_proj))


def _sorted_routing(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().argsort(dim=1)
    return w.float().gather(1, order), ids.long().gather(1, order)


def measure_block_point(model: str, t: int, spec: BlockModel, methods: dict, args: argparse.Namespace, bu: Any,
                        device: str, rel_tol: float, cgen: torch.Generator) -> dict:
    """Check (routing and outputs against transformers' block) and time one (model, T) point over `BLOCK_SETS`
    rotating input sets; ms per call. ``methods``: name -> module called as ``mod(x)``, ``hf_block`` first."""
    sets = [(torch.randn(t, spec.hidden, generator=cgen, device=device).to(torch.bfloat16),)
            for _ in range(BLOCK_SETS)]
    errors: dict[str, str] = {}
    accuracy: dict[str, float] = {}
    hf = methods["hf_block"]
    x0 = sets[0][0]
    ref = hf(x0).float()
    hit_sets = []
    for (x,) in sets:
        _, _, ids = hf.gate(x)
        hit_sets.append(torch.unique(ids).numel())
    _, w_ref, ids_ref = hf.gate(x0)
    w_ref, ids_ref = _sorted_routing(w_ref, ids_ref)
    route_check = {}
    cases = {"hf_block": (hf, sets)}
    for name, mod in methods.items():
        if name == "hf_block":
            continue
        try:
            out = mod(x0)
            sync(device)
        except Exception as exc:  # noqa: BLE001
            if name not in BLOCK_OPTIONAL:
                raise
            errors[name] = short_error(exc)
            continue
        if not route_check:
            w, ids = _sorted_routing(*mod.routing(x0))
            mismatch = float((ids != ids_ref).any(dim=1).float().mean())
            same = (ids == ids_ref).all(dim=1)
            route_check = {"mismatch_fraction": mismatch,
                           "weight_max_abs_diff": float((w - w_ref)[same].abs().max()) if bool(same.any()) else None}
            if not mismatch <= ROUTE_MISMATCH_MAX:
                raise AccuracyError(f"{model} block T={t}: moe_route chose other experts than transformers' router "
                                    f"for {mismatch:.1%} of the tokens (bound {ROUTE_MISMATCH_MAX:.0%})")
        accuracy[name] = checked_rel_err(out, ref, rel_tol, f"{model} block T={t}: {name}", "transformers' bf16 block")
        cases[name] = (mod, sets)
    timings = time_cases(cases, errors, bu, args, BLOCK_OPTIONAL)
    times = {name: tm.median_ms for name, tm in timings.items()}
    eager = {}
    if t <= args.eager_max_t:
        eager_fns = {n: (lambda mod=methods[n]: mod(x0)) for n in ("hf_block", "ours_block", "ours_block_fused")
                     if n in times}
        try:
            eager = time_eager(eager_fns, steps=args.eager_steps, warmup=min(3, args.eager_steps), device=device)
        except Exception as exc:  # noqa: BLE001
            errors["eager"] = short_error(exc)
    # the weight bytes the experts hit by a call read (the mean over the sets; the shared expert counted as one more)
    hits = statistics.mean(hit_sets) + spec.shared
    active = {n: hits * expert_bytes(methods[n]) for n in times}
    return {"model": model, "T": t, "time_ms": times, "errors": errors, "rel_err_vs_hf_bf16": accuracy,
            "routing_check": route_check, "experts_hit_mean": statistics.mean(hit_sets),
            "active_weight_bytes_mean": active,
            "eager_ms": {n: v["median_ms"] for n, v in eager.items()},
            "eager_host_ms": {n: v["host_ms"] for n, v in eager.items()},
            "timing": {n: {"calls_per_replay": tm.calls_per_replay, "copies": tm.copies, "min_ms": tm.min_ms,
                           "max_ms": tm.max_ms} for n, tm in timings.items()}}


def run_block(args: argparse.Namespace, cw: Any, bu: Any, results: dict, device: str, rel_tol: float) -> None:
    """The block part over ``args.block_models`` and ``args.block_tokens``: points into ``results["block_points"]``,
    per-model facts into ``results["block_models"]``, failures into ``results["block_errors"]``. One model's
    weights at a time (freed before the next)."""
    cgen = torch.Generator(device=device).manual_seed(args.seed + 2)
    errs = results.setdefault("block_errors", {})
    results["block_routing"] = "W8A8MoE.route (cutlass_w8a8.ops.moe.moe_route, sigmoid scoring)"
    for model in args.block_models:
        spec = BLOCK_MODELS[model]
        try:
            hf = hf_block(spec, device, cgen)
        except Exception as exc:  # noqa: BLE001 (no transformers, or its API moved: nothing to compare with)
            errs[model] = f"transformers' {spec.block}: {short_error(exc)}"
            continue
        methods: dict[str, nn.Module] = {"hf_block": hf}
        for scheme in args.block_schemes:
            try:
                methods.update(build_ours(cw, hf, spec, scheme))
            except Exception as exc:  # noqa: BLE001
                if f"ours_{scheme}" not in BLOCK_OPTIONAL:
                    raise
                errs[f"{model} ours_{scheme}"] = short_error(exc)
        sync(device)
        results.setdefault("block_models", {})[model] = {
            **dataclasses.asdict(spec),
            "weight_bytes": {"hf_block": tensor_bytes(hf),
                             **{f"ours_{s}": tensor_bytes(methods[f"ours_{s}_fused"].fused)
                                + tensor_bytes(methods[f"ours_{s}"].shared) for s in SCHEMES
                                if f"ours_{s}" in methods}}}
        for t in args.block_tokens:
            p = measure_block_point(model, t, spec, methods, args, bu, device, rel_tol, cgen)
            results["block_points"].append(p)
            tm = p["time_ms"]
            print(f"  block {model} T={t}: " + ", ".join(f"{m} {tm[m] * 1e3:.1f} us" for m in tm)
                  + ("" if not p["errors"] else f" (did not run: {', '.join(p['errors'])})"), flush=True)
        del methods, hf
        if device == "cuda":
            torch.cuda.empty_cache()
