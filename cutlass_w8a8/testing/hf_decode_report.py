"""bench/bench_hf.py's gates and reports: the speedup and warm-up targets and logits gates, the targets against
the package's own decoder (`targets_vs_decoder`), the Markdown tables (latency with warm-up and the graph step each
graph row ran, accuracy), `recheck` (a results file re-evaluated with the current gates), `render_markdown`,
`plot_results` and `write_outputs` (``<prefix>_<device>.{json,md,png}``). Here so that the script keeps working
when loaded by path (tests/bench/test_bench_hf_cpu.py); importing it touches no GPU.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from cutlass_w8a8.testing.report import save_figure, write_results

# bf16; W8A8 as quantize_ leaves it (one W8A8Linear per projection); "-opt": the same after cutlass_w8a8.optimize_
# (fused q/k/v and gate/up, RMSNorm and SiLU*mul fused with the activation quantization)
MODELS = ("bf16", "int8", "fp8", "fp8-block", "int8-opt", "fp8-opt", "fp8-block-opt")
W8A8 = MODELS[1:]
OPTIMIZED = ("int8-opt", "fp8-opt", "fp8-block-opt")
# eager: model.forward; compiled: torch.compile(reduce-overhead) of model.forward; graph: cutlass_w8a8.generate's
# decode step (GraphGenerator: its step, "cw" or "transformers", captured eagerly into a CUDA graph, no torch.compile)
MODES = ("eager", "compiled", "graph")
# bench_hf.py --decoder: the package's own reference decoder (cutlass_w8a8.models.LlamaDecoder, int8) through
# DecodeGraphRunner, a row of the graph mode (a "model" of results["dtypes"] / results["points"]); issue 28 wants
# each -opt model's graph ms/token within DECODER_WITHIN x the decoder's graph step, same run
DECODER = "decoder int8 (cutlass_w8a8.models)"
DECODER_WITHIN = 1.1

# Speedup targets: (models, mode, batch, baseline mode) -> W8A8 ms/token of bf16 in the baseline mode over the
# model's own. Issue 28 (optimized models): compiled >= 1.65x bf16 compiled at batch 1 and >= 1.5x at batch 8;
# cutlass_w8a8.generate's graph path >= 1.6x bf16 compiled; eager >= 1.2x bf16 eager at batch 1. The unoptimized
# W8A8 models keep the earlier targets (compiled 1.6x / 1.5x, eager 1.0x at batch 1).
TARGETS = [
    (OPTIMIZED, "compiled", 1, "compiled", 1.65),
    (OPTIMIZED, "compiled", 8, "compiled", 1.5),
    (OPTIMIZED, "graph", 1, "compiled", 1.6),
    (OPTIMIZED, "graph", 8, "compiled", 1.6),
    (OPTIMIZED, "eager", 1, "eager", 1.2),
    (("int8", "fp8"), "compiled", 1, "compiled", 1.6),
    (("int8", "fp8"), "compiled", 8, "compiled", 1.5),
    (("int8", "fp8"), "eager", 1, "eager", 1.0),
]
# Targets of the other model configurations (bench_hf.py --config; results["config_name"]), in the same form plus
# the issue that sets them; they replace TARGETS and the warm-up target (both the Llama-3-8B model's). Issue 36:
# cutlass_w8a8.generate's graph path (the step it ran named) >= 2.5x bf16 compiled at batch 1 on a Qwen3-MoE model
# at Qwen3-30B-A3B dims with as many layers as fit beside the bf16 copy. GLM-4.5-Air: no issue sets a target (the
# report has the measurements only, not the Llama model's targets).
CONFIG_TARGETS = {
    "qwen3-30b-a3b": [(OPTIMIZED, "graph", 1, "compiled", 2.5, "issue 36")],
    "glm-4.5-air": [],
}
# Warm-up target of the graph path (seconds from the start to the first decode token, capture included), on the
# full 32-layer model; torch.compile takes 35-44 s there.
GRAPH_WARMUP_MAX_S = 10.0

# Sanity gates on the logits of the benchmark's own model. They catch a broken path, not rounding: accuracy
# has its gates in the tests, on models where they mean something (tests/hf/test_hf_generate.py,
# tests/hf/test_hf_optimize_cpu.py, tests/hf/test_hf_generate_graph_cuda.py: graph replay equal to eager bit for bit).
# A 32-layer model with random weights amplifies every rounding difference layer after layer: on an H100
# (2026-11-23) the bf16 model compiled vs its own eager run gave 25 dB, int8 12-13 dB, fp8 9 dB, and W8A8 eager vs
# bf16 eager 10 dB (int8) and 4 dB (fp8). A broken path (wrong strides, a stale cache position, the replay of old
# inputs) gives 0 dB or less: the gates sit above that. The graph path replays the eager kernels: expected equal.
COMPILED_MIN_SQNR_DB = {m: 6.0 for m in MODELS}
GRAPH_MIN_SQNR_DB = {m: 6.0 for m in MODELS}
# W8A8 logits vs the bf16 model's, last check step (positive: the logits are correlated, not noise).
W8A8_MIN_SQNR_DB = {m: 1.0 for m in W8A8}


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _graph_step_cell(results: dict[str, Any], b: str, mode: str, m: str, reasons: list[str]) -> str:
    """The "graph step" cell of one latency row: ``–`` outside the graph mode (and where the results record no
    step); ``DecodeGraphRunner`` for our decoder (``(eager: no CUDA)`` where its runner captured no graph); else the
    step the model's GraphGenerator ran (``results["graph_step"][b][m]["step"]``), with ``(auto fell back, note
    i)`` where ``step="auto"`` fell back, its reason appended to ``reasons`` (once; ``i`` is its 1-based index)."""
    if mode != "graph":
        return "–"
    if m == DECODER:
        graphs = (results.get("decoder") or {}).get("batches", {}).get(b, {}).get("graphs", True)
        return "DecodeGraphRunner" if graphs else "DecodeGraphRunner (eager: no CUDA)"
    st = results.get("graph_step", {}).get(b, {}).get(m)
    if not st:
        return "–"
    cell = st["step"]
    if st.get("reason"):
        if st["reason"] not in reasons:
            reasons.append(st["reason"])
        cell += f" (auto fell back, note {reasons.index(st['reason']) + 1})"
    return cell


def latency_table(results: dict[str, Any]) -> str:
    """The per-token latency table (Markdown): one row per (batch, mode, model) measured, in the order of
    ``results["batches"]``, ``["modes"]`` and ``["dtypes"]`` (our decoder's graph row included), with ms/token,
    the speedups over bf16, the warm-up seconds and the graph step (`_graph_step_cell`); followed, after a blank
    line, by the numbered notes on why ``step="auto"`` fell back to the transformers step, where it did."""
    rows = ["| batch | mode | model | ms/token | x bf16 same mode | x bf16 compiled | first token s | "
            "graphs replay after s | graph step |", "|---:|:---|:---|---:|---:|---:|---:|---:|:---|"]
    reasons: list[str] = []
    for b in results["batches"]:
        point = results["points"].get(str(b), {})
        for mode in results["modes"]:
            for m in results["dtypes"]:
                t = point.get(m, {}).get(mode)
                if t is None:
                    continue
                d = results["derived"].get(str(b), {}).get(mode, {}).get(m, {})
                w = results["warmup"].get(str(b), {}).get(m, {}).get(mode, {})
                row = (f"| {b} | {mode} | {m} | {t['median_ms']:.3f} | {_fmt(d.get('x_bf16_same_mode'), '.2f')}x "
                       f"| {_fmt(d.get('x_bf16_compiled'), '.2f')}x | {_fmt(w.get('first_token_s'), '.2f')} "
                       f"| {_fmt(w.get('replaying_after_s'), '.2f')} |").replace("–x", "–")
                rows.append(f"{row} {_graph_step_cell(results, str(b), mode, m, reasons)} |")
    if reasons:
        rows += [""] + [f"{i}. `step='auto'` chose the transformers step: {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(rows)


def _gate(results: dict[str, Any], failures: list, b, m: str, a: dict) -> None:
    for key, gates, what in (("compiled_vs_eager", COMPILED_MIN_SQNR_DB, "compiled"),
                             ("graph_vs_eager", GRAPH_MIN_SQNR_DB, "graph")):
        cve = a.get(key)
        if cve:
            cve["min_sqnr_db"] = gates.get(m, 6.0)
            cve["ok"] = cve["worst_sqnr_db"] >= cve["min_sqnr_db"]
            if not cve["ok"]:
                failures.append(f"batch {b} {m}: {what} vs eager logits SQNR {cve['worst_sqnr_db']:.1f} dB "
                                f"< {cve['min_sqnr_db']} dB")
    if m in W8A8_MIN_SQNR_DB and a.get("eager_sqnr_vs_bf16_db") is not None:
        a["w8a8_ok"] = a["eager_sqnr_vs_bf16_db"] >= W8A8_MIN_SQNR_DB[m]
        if not a["w8a8_ok"]:
            failures.append(f"batch {b} {m}: eager logits SQNR vs bf16 {a['eager_sqnr_vs_bf16_db']:.1f} dB "
                            f"< {W8A8_MIN_SQNR_DB[m]} dB")


def apply_gates(results: dict[str, Any]) -> list:
    """The logits-gate failures of ``results["accuracy"]`` (each entry's ``ok`` flags set)."""
    failures: list = []
    for b, acc in results["accuracy"].items():
        for m, a in acc.items():
            _gate(results, failures, b, m, a)
    return failures


def recheck(results: dict[str, Any], source: str) -> None:
    """Re-evaluate the logits checks of ``results`` (a results file of this script) with the current gates,
    keeping every measured value; the failures of variants that raised are kept."""
    failures = [f for f in results.get("failures", []) if "logits SQNR" not in f]
    results["failures"] = failures + apply_gates(results)
    results["tolerances"] = {"compiled_vs_eager_min_sqnr_db": COMPILED_MIN_SQNR_DB,
                             "graph_vs_eager_min_sqnr_db": GRAPH_MIN_SQNR_DB,
                             "w8a8_vs_bf16_min_sqnr_db": W8A8_MIN_SQNR_DB}
    results["rechecked"] = (f"logits checks re-evaluated from {os.path.basename(source)} with the gates of "
                            "bench_hf.py at the commit that holds this file; measured values unchanged")


def derive(results: dict[str, Any]) -> None:
    """Speedups over bf16 (its ms/token in the same mode, and compiled) per batch, mode and model, and the
    targets."""
    derived: dict[str, dict] = {}
    for b, point in results["points"].items():
        base = point.get("bf16", {})
        for mode in results["modes"]:
            for m, per_mode in point.items():
                cur = per_mode.get(mode)
                if cur is None:
                    continue
                same, comp = base.get(mode), base.get("compiled")
                derived.setdefault(b, {}).setdefault(mode, {})[m] = {
                    "x_bf16_same_mode": same["median_ms"] / cur["median_ms"] if same and m != "bf16" else None,
                    "x_bf16_compiled": comp["median_ms"] / cur["median_ms"] if comp and m != "bf16" else None}
    results["derived"] = derived
    targets = []
    config_name = results.get("config_name", "llama3-8b")
    rows = [(*row, None) for row in TARGETS] if config_name not in CONFIG_TARGETS else CONFIG_TARGETS[config_name]
    for models, mode, b, base_mode, target, issue in rows:
        for m in models:
            if m not in results["dtypes"]:
                continue
            key = "x_bf16_same_mode" if base_mode == mode else f"x_bf16_{base_mode}"
            value = derived.get(str(b), {}).get(mode, {}).get(m, {}).get(key)
            targets.append({"model": m, "mode": mode, "batch": b, "baseline": f"bf16 {base_mode}", "target": target,
                            "value": value, "met": None if value is None or not results["full_size"] else
                            value >= target})
            if issue:  # the step the graph ran, named in the target's line
                targets[-1]["issue"] = issue
                targets[-1]["graph_step"] = results.get("graph_step", {}).get(str(b), {}).get(m, {}).get("step")
    if config_name in CONFIG_TARGETS:
        results["targets"] = targets
        return
    for b, per_model in results.get("warmup", {}).items():
        for m, w in per_model.items():
            g = w.get("graph", {}).get("first_token_s")
            if g is not None:
                targets.append({"model": m, "mode": "graph warm-up", "batch": int(b), "baseline": "seconds",
                                "target": GRAPH_WARMUP_MAX_S, "value": g, "max": True,
                                "met": None if not results["full_size"] else g <= GRAPH_WARMUP_MAX_S})
    results["targets"] = targets


def targets_vs_decoder(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 28: each ``-opt`` model's graph ms/token over our decoder's graph step (`DECODER`) at the same batch
    (same run), ``ratio <= DECODER_WITHIN``; one entry per (batch with a decoder graph point, ``-opt`` model of
    ``results["dtypes"]``), ``ratio`` None where the model has no graph point; ``met`` is None where the ratio is
    missing or the run is not the full 32-layer GPU model (``results["full_size"]``)."""
    out = []
    for b in results["batches"]:
        point = results["points"].get(str(b), {})
        dec = point.get(DECODER, {}).get("graph")
        if dec is None:
            continue
        for m in results["dtypes"]:
            if not m.endswith("-opt"):
                continue
            cur = point.get(m, {}).get("graph")
            ratio = cur["median_ms"] / dec["median_ms"] if cur else None
            step = results.get("graph_step", {}).get(str(b), {}).get(m, {}).get("step")
            out.append({"model": m, "mode": "graph", "batch": b, "graph_step": step,
                        "ms_per_token": cur["median_ms"] if cur else None, "decoder_ms": dec["median_ms"],
                        "ratio": ratio, "target_max": DECODER_WITHIN,
                        "met": None if ratio is None or not results["full_size"] else ratio <= DECODER_WITHIN})
    return out


def accuracy_table(results: dict[str, Any]) -> str:
    rows = ["| batch | model | eager logits SQNR vs bf16 dB | compiled vs eager: worst SQNR dB / max abs "
            "| graph vs eager: worst SQNR dB / max abs | checks |", "|---:|:---|---:|---:|---:|:---|"]
    for b in results["batches"]:
        for m, a in results["accuracy"].get(str(b), {}).items():
            cells, checks = [], []
            for key, what in (("compiled_vs_eager", "compiled"), ("graph_vs_eager", "graph")):
                c = a.get(key)
                cells.append("–" if not c else "equal" if c["max_abs"] == 0 else
                             f"{c['worst_sqnr_db']:.1f} / {c['max_abs']:.3g}")
                if c and "ok" in c:
                    checks.append(f"{what} {'ok' if c['ok'] else 'FAIL'} (>= {c['min_sqnr_db']} dB)")
            if "w8a8_ok" in a:
                checks.append(f"vs bf16 {'ok' if a['w8a8_ok'] else 'FAIL'} (>= {W8A8_MIN_SQNR_DB[m]} dB)")
            e = a.get("eager_sqnr_vs_bf16_db")
            rows.append(f"| {b} | {m} | {'ref' if m == 'bf16' else _fmt(e, '.1f')} | {cells[0]} | {cells[1]} "
                        f"| {'; '.join(checks) or '–'} |")
    return "\n".join(rows)


def _graph_bullet(results: dict[str, Any]) -> str:
    """The "graph:" description bullet: the GraphGenerator call and both of its decode steps (the transformers step
    only where the results record no ``graph_step_requested``: a GraphGenerator without ``step=``)."""
    req = results.get("graph_step_requested")
    capture = "captured eagerly with `cutlass_w8a8.graphs.capture`, inputs written with `copy_`, replayed"
    if not req:
        return f"- graph: `cutlass_w8a8.hf.GraphGenerator(model, sizes=[B])`'s decode step (the same call, {capture})"
    return (f"- graph: `cutlass_w8a8.hf.GraphGenerator(model, sizes=[B], step='{req}')`'s decode step, {capture}. "
            "With step `cw` (`step='auto'`'s choice for an `optimize_`d model) the step is "
            "`cutlass_w8a8.hf.DecodeStep`: the package's decoder-layer code over the model's own fused modules and "
            "weights (fused residual add + RMSNorm + activation quantization, one rotary + KV-write kernel, split-KV "
            "decode attention with `o_proj`'s quantization fused, the qkv, o_proj, gate_up and down GEMMs) on a KV "
            "cache of its own; the prefill runs through `model.forward` on a `DynamicCache`, its keys and values "
            "then copied into that cache. With step `transformers`: the model's own forward, the decode-step call "
            "above on a `StaticCache`, captured; prefill eager through `model.forward`")


def _step_notes(results: dict[str, Any]) -> list[str]:
    """The description bullets on the graph step (where the graph mode ran) and on our decoder (where it was
    built)."""
    lines = []
    if "graph" in results["modes"]:
        req = results.get("graph_step_requested")
        lines.append("- graph step: the decode step the graph path captured, "
                     + (f"`GraphGenerator(..., step='{req}')`" if req else "a GraphGenerator without `step=`")
                     + ": `cw`, the package's decoder-layer code over the optimize_d model's fused modules (fused "
                     "norm + quantization, rope + KV write, split-KV decode attention, on a KV cache of its own); "
                     "`transformers`, the `model.forward` call above")
    info = results["models"].get(DECODER)
    if info:
        lines.append(f"- {DECODER}: `{info['call']}` at the same dimensions and layers (random weights; embedding "
                     "and lm_head: the bf16 model's), its decode step captured by `DecodeGraphRunner(model, "
                     "max_batch=B, sizes=[B])` with device inputs; per repetition its cache zeroed and the prompt "
                     "fed through the step (its prefill, untimed), then the same decode steps at the same positions, "
                     "timed round-robin with the other variants")
    return lines


def _decoder_target_lines(results: dict[str, Any]) -> list[str]:
    """The Markdown lines of ``results["targets_vs_decoder"]`` (`targets_vs_decoder`'s entries)."""
    lines = []
    for t in results.get("targets_vs_decoder", []):
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        value = ("–" if t["ratio"] is None else
                 f"{t['ms_per_token']:.3f} ms/token = {t['ratio']:.2f}x our decoder's graph step "
                 f"({t['decoder_ms']:.3f} ms, same run)")
        step = f" (graph step {t['graph_step']})" if t.get("graph_step") else ""
        lines.append(f"- {t['model']} graph{step} batch {t['batch']}: {value} (target: graph ms/token within "
                     f"{t['target_max']}x of our decoder's graph step): {verdict}")
    return lines


def _commit_text(results: dict[str, Any]) -> str:
    """``git <commit>`` (a hex hash cut to 12 digits; any other text, such as a note on where the hash came from,
    whole), `` (dirty)`` appended where ``git_dirty``; ``git: n/a`` without a commit."""
    commit = results.get("git_commit")
    if not commit:
        return "git: n/a"
    shown = commit[:12] if all(ch in "0123456789abcdef" for ch in commit.lower()) else commit
    return f"git {shown}{' (dirty)' if results.get('git_dirty') else ''}"


def _moe_dims(c: dict[str, Any]) -> str:
    """The experts' part of the dimensions line (empty for a dense config)."""
    if not c.get("num_experts"):
        return ""
    return (f"; MLP: {c['num_experts']} experts of {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}"
            f"{' renormalized' if c.get('norm_topk_prob') else ''}, bf16 experts "
            f"`experts_implementation={c.get('experts_implementation')!r}` "
            + (f"(MLP above: the first {c['first_k_dense_replace']} layer(s)' dense MLP; the others' blocks also have "
               f"{c.get('n_shared_experts')} shared expert(s) of {c['moe_intermediate_size']})"
               if c.get("first_k_dense_replace") else "(MLP above: the config's dense width, unused)"))


def _layers_rule_line(results: dict[str, Any]) -> list[str]:
    """The bullet on how the default ``--layers`` was chosen, where a rule chose it."""
    r = results.get("layers_rule")
    if not r:
        return []
    return [f"- layers: {r['layers']}, {r['rule']} ({r['fixed_GiB']:.2f} GiB + {r['per_layer_GiB']:.3f} GiB per "
            f"layer, {r['free_GiB']:.1f} GiB free at the start)"]


def render_markdown(results: dict[str, Any]) -> str:
    """The Markdown report of ``results`` (bench_hf.py's results dict, or a results file as `recheck` leaves it):
    the run's description (the graph step and our decoder included), the latency table with the graph step of each
    row and the notes on ``step="auto"``'s fall-backs, the correctness table, the targets (over bf16, warm-up, and
    against our decoder's graph step where ``results["targets_vs_decoder"]`` has entries), failures, left-out
    variants and notes. Ends with a newline."""
    commit_text = _commit_text(results)
    c = results["config"]
    t = results["timing"]
    lines = [f"# transformers {c.get('model_class', 'LlamaForCausalLM')} decode: {results['device']}", ""]
    if results["tiny"]:
        lines += ["**CPU run of a tiny config (`--tiny`): the ops run their CPU reference implementations. It "
                  "checks the flow; the times below are not measurements of anything.**", ""]
    elif not results["full_size"]:
        lines += [f"**{c['num_hidden_layers']} decoder layers, not {c.get('dims', 'Llama-3-8B')}'s "
                  f"{c.get('full_layers', 32)} (`--quick` or `--layers`): "
                  "per-layer costs shrink and the fixed costs (embedding, lm_head, launches) weigh more, so the "
                  "ratios and warm-up times are not the full model's; targets are not judged.**", ""]
    lines += [
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), transformers "
        f"{results['transformers_version']}, {commit_text}",
        f"- {c['name']} dimensions, {c['num_hidden_layers']} layers: hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, heads {c['num_attention_heads']}/{c['num_key_value_heads']} x {c['head_dim']}, "
        f"vocab {c['vocab_size']}, rope_theta {c['rope_theta']:g}; random weights; attention "
        f"{c['attn_implementation']}" + _moe_dims(c),
        *_layers_rule_line(results),
        "- W8A8: `quantize_(copy, W8A8Config(dtype=..., weight_block_size=(128, 128) for fp8-block), filter_fn="
        "lambda m, fqn: \"lm_head\" not in fqn)` (per-channel weights, dynamic per-token activations; block: "
        "128x128 weight blocks, 1x128 activation groups; embedding and lm_head bf16, shared with the bf16 model"
        + ("; the experts become `W8A8MoE`, the routers stay bf16 (shared)" if c.get("num_experts") else "") + "); "
        "`-opt`: then `cutlass_w8a8.optimize_`. Weights: "
        + ", ".join(f"{m} {_size(r['weight_bytes'])}" for m, r in results["models"].items()),
        f"- decode step: `model(input_ids=(B, 1), past_key_values=StaticCache, position_ids=(B, 1), attention_mask="
        f"(B, 1, 1, {results['max_cache_len']}) bool, use_cache=True)`, StaticCache of {results['max_cache_len']} "
        f"positions, {results['prompt_len']}-token prompt prefilled eagerly",
    ]
    if results["compile"]:
        lines.append(f"- compiled: `{results['compile']['call']}`, the decode step only (prefill eager)")
    if "graph" in results["modes"]:
        lines.append(_graph_bullet(results))
    lines += [
        f"- ms/token = median over {t['reps']} repetitions of {t['steps']} decode steps ({t['method']}); the "
        "variants of a batch timed round-robin",
        "- first token s: from the start of the path's first use (graph: bucket creation with warm-up and "
        "capture, then the prefill) to the first decode step's logits; compiled: the compile is in the first step, "
        "its CUDA graph recorded in the second (graphs replay after)",
        *_step_notes(results),
        "",
        "## Per-token latency and warm-up",
        "",
        latency_table(results),
        "",
        "## Correctness (logits of the check steps, same tokens for every model)",
        "",
        accuracy_table(results),
        "",
        "## Targets",
        "",
    ]
    for tgt in results["targets"]:
        if tgt["batch"] not in results["batches"]:
            continue
        verdict = "n/a" if tgt["met"] is None else ("met" if tgt["met"] else "NOT met")
        if tgt.get("max"):
            lines.append(f"- {tgt['model']} {tgt['mode']} batch {tgt['batch']}: {_fmt(tgt['value'], '.2f')} s "
                         f"(target <= {tgt['target']} s on 32 layers): {verdict}")
        else:
            value = "–" if tgt["value"] is None else f"{tgt['value']:.2f}x"
            step = f" (graph step {tgt['graph_step']})" if tgt.get("graph_step") else ""
            issue = f", {tgt['issue']}" if tgt.get("issue") else ""
            lines.append(f"- {tgt['model']} {tgt['mode']}{step} batch {tgt['batch']}: {value} over {tgt['baseline']} "
                         f"(target >= {tgt['target']}x{issue}): {verdict}")
    lines += _decoder_target_lines(results) or [
        f"- graph path within {DECODER_WITHIN}x of the package's own decoder's graph step at the same dims: compare "
        "the graph rows with bench/bench_decoder.py's results on this device (not measured here)"]
    if results["failures"]:
        lines += ["", "## FAILED checks", ""] + [f"- {f}" for f in results["failures"]]
    if results["errors"]:
        lines += ["", "## Left out", ""] + [f"- `{m}`: {msg}" for m, msg in results["errors"].items()]
    if results.get("png_note"):
        lines += ["", f"({results['png_note']})"]
    if results.get("rechecked"):
        lines += ["", f"({results['rechecked']}.)"]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: ms/token per (batch, mode) for each model, and each W8A8 model's speedup over bf16 compiled; our
    decoder (`DECODER`, bench_hf.py --decoder) is one more model, its bars in the graph groups only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(b, mode) for b in results["batches"] for mode in results["modes"]]
    labels = [f"B={b}\n{mode}" for b, mode in groups]
    models = [m for m in (*MODELS, DECODER) if m in results["models"]]
    fig, (ax_lat, ax_x) = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / max(1, len(models))
    for i, m in enumerate(models):
        ys = [results["points"].get(str(b), {}).get(m, {}).get(mode, {}).get("median_ms", float("nan"))
              for b, mode in groups]
        ax_lat.bar([g + (i - (len(models) - 1) / 2) * width for g in range(len(groups))], ys, width, label=m)
    ax_lat.set_ylabel("ms per decode step (= per token of each sequence)")
    ax_lat.set_title("Per-token decode latency")
    ratios = [m for m in models if m != "bf16"]
    width = 0.8 / max(1, len(ratios))
    for i, m in enumerate(ratios):
        ys = [results["derived"].get(str(b), {}).get(mode, {}).get(m, {}).get("x_bf16_compiled") for b, mode in groups]
        ys = [float("nan") if y is None else y for y in ys]
        ax_x.bar([g + (i - (len(ratios) - 1) / 2) * width for g in range(len(groups))], ys, width, label=m)
    ax_x.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    for y in (1.5, 1.6, 1.65):
        ax_x.axhline(y, color="gray", linestyle=":", linewidth=0.8)
    ax_x.set_ylabel("speedup over bf16 compiled (x); dotted: targets 1.5 / 1.6 / 1.65")
    ax_x.set_title("W8A8 over bf16 compiled")
    for ax in (ax_lat, ax_x):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    c = results["config"]
    title = (f"transformers {c.get('model_class', 'Llama')} ({c['name']} x {c['num_hidden_layers']} "
             f"layers), {results['device']}, "
             f"torch {results['torch_version']}")
    save_figure(fig, path, title + (" - CPU reference ops, not a measurement" if results["tiny"] else ""))


def write_outputs(results: dict[str, Any], out_dir: str, prefix: str = "hf_decode") -> dict[str, str]:
    """Write ``<prefix>_<slug>.json``, ``.md`` (`render_markdown`) and ``.png`` (`plot_results`) to ``out_dir``
    (cutlass_w8a8.testing.report's write_results; ``<slug>``: ``results["device_slug"]``); without matplotlib the
    PNG is left out and the report says so. Returns the paths written, by extension."""
    try:
        import matplotlib  # noqa: F401
        plot = plot_results
    except ImportError:
        results["png_note"] = "no PNG: matplotlib is not installed"

        def plot(results, path):
            return None
    paths = write_results(results, render_markdown(results), out_dir, prefix, plot)
    return {ext: p for ext, p in paths.items() if os.path.exists(p)}
