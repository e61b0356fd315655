"""bench/bench_decoder.py's models, derived numbers, targets and reports: `MODELS` and `model_spec`, `derive`
(speedups, measured / HBM-limited time, the issue-18 targets), the Markdown tables (latency, bandwidth, HBM
bound, kernel classes, PDL on/off, capture), `render_markdown` of a results dict and `plot_results` (needs
matplotlib). Pure Python: nothing here needs a GPU.
"""

from __future__ import annotations

from typing import Any, Optional

from _decoder_kernels import CLASS_BYTES_NOTES, CLASSES, OTHER_NAMES_MAX
from cutlass_w8a8.testing.physical import judge, mark, physical_check, verdict
from cutlass_w8a8.testing.report import markdown, save_figure

# Model names: a base ("bf16": nn.Linear layers; "int8" / "fp8": W8A8Linear decoder layers, per-channel weights and
# per-token activations; "fp8-block": block-scaled fp8 W8A8Linear, 128x128 weight blocks and 1x128 activation
# groups), "+lmh" = lm_head quantized too (W8A8Linear); without it lm_head stays a bf16 nn.Linear. MODELS lists
# every accepted name in report order; DEFAULT_MODELS are run by default.
MODELS = ("bf16", "int8", "int8+lmh", "fp8", "fp8+lmh", "fp8-block", "fp8-block+lmh")
DEFAULT_MODELS = ("bf16", "int8", "int8+lmh", "fp8", "fp8-block")
MODES = ("eager", "graph")
LMH = "+lmh"

# Targets (issue 18), Llama-3-8B dimensions, all 32 layers:
TARGET_INT8_OVER_BF16 = 2.0    # int8 graph >= 2.0x bf16 graph at batch 1 (bf16 lm_head in both)
TARGET_GRAPH_OVER_EAGER = 1.5  # W8A8 (int8) graph >= 1.5x its eager step at batch 1
TARGET_B1_OVER_HBM = 1.25      # int8 graph at batch 1 <= 1.25x its HBM-limited time
TARGET_B8_OVER_HBM = 1.3       # int8 graph at batch 8 <= 1.3x its HBM-limited time
# Target (issue 26): the block-scaled fp8 graph step at batch 1 <= 1.1x the row-wise fp8 one (bf16 lm_head in both).
TARGET_BLOCK_OVER_FP8 = 1.1
# Target (issue 27): Qwen3-30B-A3B dims (the "qwen3-30b-a3b" config), W8A8 graph step >= 1.6x the bf16 one at batch 1.
TARGET_MOE_W8A8_OVER_BF16 = 1.6
MOE_CONFIG = "qwen3-30b-a3b"
# The absolute batch-1 int8 graph step time of the issue, ms, by device name (first match; None: no target),
# for its setting only: llama3-8b, 32 layers, --max-seq 512 (1.25x the limit of 8.07 GB at 3.35 / 4.8 TB/s).
TARGET_B1_MS = (("H100 PCIe", None), ("H100 NVL", None), ("H100", 3.0), ("H200", 2.1))
TARGET_B1_MS_SETTING = {"name": "llama3-8b", "num_layers": 32, "max_seq": 512}


def model_spec(name: str) -> tuple[Optional[str], bool]:
    """``(quant, quant_lm_head)`` of a model name of `MODELS`: ``"bf16"`` -> ``(None, False)``, ``"int8"`` ->
    ``("int8", False)``, ``"int8+lmh"`` -> ``("int8", True)``, ``"fp8-block"`` -> ``("fp8-block", False)``
    (`cutlass_w8a8.models.LlamaDecoder`'s ``quant``). Raises ValueError for another name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    base = name[:-len(LMH)] if name.endswith(LMH) else name
    return (None if base == "bf16" else base), name.endswith(LMH)


def absolute_target_ms(device: str) -> Optional[float]:
    """The issue's absolute batch-1 target (ms) for ``device`` (`TARGET_B1_MS`), None when it has none."""
    return next((ms for key, ms in TARGET_B1_MS if key in device), None)


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _num(v: Optional[float]) -> str:
    """3 significant digits below 100 (0.00061, 3.98, 33.7), a whole number above; "–" for None."""
    if v is None:
        return "–"
    return "0" if v == 0 else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}")


def _mib(n: Optional[int]) -> str:
    return "–" if n is None else f"{n / 2**20:.0f}"


def _models(results: dict[str, Any]) -> list[str]:
    return [m for m in MODELS if m in results["models"]]


# ----------------------------------------------------------------------------------------------------
# derived numbers and targets


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def _target(key: str, label: str, value: Optional[float], bound: Optional[float], sense: str,
            detail: str = "", invalid: Optional[str] = None) -> dict[str, Any]:
    """One target: ``met`` is None where the value or the bound is missing, or where ``invalid`` (a
    `physical_check` reason) says the value is impossible."""
    met = None
    if value is not None and bound is not None:
        met = value <= bound if sense == "<=" else value >= bound
    met, invalid = judge(met, invalid)
    return {"key": key, "label": label, "value": value, "bound": bound, "sense": sense, "met": met,
            "detail": detail, "invalid": invalid}


def hbm_limit_check(value: Optional[float], what: str) -> Optional[str]:
    """A step's time over its HBM-limited time (the bytes it must read at the datasheet bandwidth) is at least 1:
    `physical_check` with ``sense=">="``."""
    return physical_check(value, 1.0, what, sense=">=")


def derive(results: dict[str, Any], copy_gbps: float) -> None:
    """Add ``results["derived"]`` and ``results["targets"]``.

    Per batch: speedups (baseline time / time: ``<m>_graph_x_bf16_graph``, ``<m>_graph_x_<m>_eager``), measured
    / HBM-limited time (``<m>_<mode>_over_hbm_limit``; None where the device's bandwidth is unknown), and the
    weight-read bandwidth of each graph step (bytes of the weights a step reads in full, all but the
    embedding, / step time, GB/s = 1e9 B/s; and over ``copy_gbps``); with the block model, its graph step time
    over the row-wise fp8 one (``fp8-block_graph_over_fp8_graph``). Targets: a list of `_target` dicts, the
    issue-18 ones (see the TARGET_* constants) and, where both fp8 models ran, issue 26's (``issue`` 26)."""
    models = results["models"]

    def point(name: str, b: int) -> Optional[dict]:
        m = models.get(name)
        return m["batches"].get(str(b)) if m and "batches" in m else None

    def t(name: str, b: int, mode: str) -> Optional[float]:
        p = point(name, b)
        return p[mode]["median_ms"] if p else None

    derived = {}
    for b in results["batches"]:
        row: dict[str, Any] = {}
        for name in models:
            if name != "bf16":
                row[f"{name}_graph_x_bf16_graph"] = _ratio(t("bf16", b, "graph"), t(name, b, "graph"))
            row[f"{name}_graph_x_{name}_eager"] = _ratio(t(name, b, "eager"), t(name, b, "graph"))
            p = point(name, b)
            limit = p.get("hbm_limit_ms") if p else None
            for mode in MODES:
                row[f"{name}_{mode}_over_hbm_limit"] = _ratio(t(name, b, mode), limit)
            tg = t(name, b, "graph")
            if tg is not None:
                # a MoE step reads only its tokens' experts: the point's expected weight bytes where recorded
                wbytes = (p or {}).get("weight_bytes_read", models[name]["weight_bytes_per_step"])
                gbps = wbytes / (tg * 1e-3) / 1e9
                row[f"{name}_graph_weight_GBps"] = gbps
                row[f"{name}_graph_weight_GBps_over_copy"] = gbps / copy_gbps
        for lmh in ("", LMH):
            if f"fp8-block{lmh}" in models and f"fp8{lmh}" in models:
                row[f"fp8-block{lmh}_graph_over_fp8{lmh}_graph"] = _ratio(t(f"fp8-block{lmh}", b, "graph"),
                                                                          t(f"fp8{lmh}", b, "graph"))
        derived[str(b)] = row
    results["derived"] = derived

    d1, d8 = derived.get("1", {}), derived.get("8", {})
    items = []
    for name in ("int8", "int8+lmh"):
        if name not in models:
            continue
        p1 = point(name, 1)
        detail = (f"{p1['graph']['median_ms']:.3f} ms, limit {_fmt(p1.get('hbm_limit_ms'), '.3f')} ms "
                  f"({p1['bytes_read'] / 1e9:.2f} GB)" if p1 else "batch 1 not measured")
        v = d1.get(f"{name}_graph_over_hbm_limit")
        items.append(_target(f"{name}_b1_over_hbm", f"{name} graph at batch 1 / its HBM-limited time",
                             v, TARGET_B1_OVER_HBM, "<=", detail,
                             hbm_limit_check(v, f"{name} graph at batch 1 / its HBM-limited time")))
    c = results["config"]
    setting = (c["name"], c["num_layers"], results["max_seq"])
    want = TARGET_B1_MS_SETTING
    bound, note = None, ""
    if setting != (want["name"], want["num_layers"], want["max_seq"]):
        note = (f"only for {want['name']} x {want['num_layers']} layers, --max-seq {want['max_seq']} "
                f"(this run: {setting[0]} x {setting[1]}, --max-seq {setting[2]})")
    else:
        bound = absolute_target_ms(results["device"])
        if bound is None:
            note = f"no absolute target for {results['device']} (H100 SXM <= 3.0 ms, H200 <= 2.1 ms)"
    items.append(_target("int8_b1_ms", f"int8 graph at batch 1, ms ({results['device']})", t("int8", 1, "graph"),
                         bound, "<=", note))
    items.append(_target("int8_x_bf16_b1", "int8 graph vs bf16 graph at batch 1 (x; bf16 lm_head in both)",
                         d1.get("int8_graph_x_bf16_graph"), TARGET_INT8_OVER_BF16, ">="))
    p8 = point("int8", 8)
    v = d8.get("int8_graph_over_hbm_limit")
    items.append(_target("int8_b8_over_hbm", "int8 graph at batch 8 / its HBM-limited time",
                         v, TARGET_B8_OVER_HBM, "<=",
                         f"{p8['graph']['median_ms']:.3f} ms, limit {_fmt(p8.get('hbm_limit_ms'), '.3f')} ms"
                         if p8 else "batch 8 not measured",
                         hbm_limit_check(v, "int8 graph at batch 8 / its HBM-limited time")))
    items.append(_target("int8_graph_x_eager_b1", "W8A8 (int8) graph vs eager at batch 1 (x)",
                         d1.get("int8_graph_x_int8_eager"), TARGET_GRAPH_OVER_EAGER, ">="))
    if "fp8-block" in models and "fp8" in models:
        pb, pf = point("fp8-block", 1), point("fp8", 1)
        detail = (f"{pb['graph']['median_ms']:.3f} ms vs {pf['graph']['median_ms']:.3f} ms" if pb and pf
                  else "batch 1 not measured")
        items.append({**_target("fp8_block_over_fp8_b1", "fp8-block graph / fp8 (row-wise) graph at batch 1 (x)",
                                d1.get("fp8-block_graph_over_fp8_graph"), TARGET_BLOCK_OVER_FP8, "<=", detail),
                      "issue": 26})
    if results["config"].get("name") == MOE_CONFIG:
        for name in ("int8", "fp8", "fp8-block"):
            if name in models:
                items.append({**_target(f"moe_{name}_x_bf16_b1", f"Qwen3-MoE decoder ({results['config']['num_layers']} "
                                        f"layers): {name} graph vs bf16 graph at batch 1 (x)",
                                        d1.get(f"{name}_graph_x_bf16_graph"), TARGET_MOE_W8A8_OVER_BF16, ">="),
                              "issue": 27})
    bytes_ratio = None
    if "bf16" in models and "int8" in models:
        bytes_ratio = models["bf16"]["weight_bytes_per_step"] / models["int8"]["weight_bytes_per_step"]
    results["targets"] = {"weight_bytes_bf16_over_int8": bytes_ratio, "items": items}


# ----------------------------------------------------------------------------------------------------
# tables


def latency_table(results: dict[str, Any]) -> str:
    """Markdown: per-token latency (ms per step) of every model and mode, and the speedups, per batch."""
    models = _models(results)
    cols = [(m, mode) for m in models for mode in MODES]
    speed = [(f"{m} graph / bf16 graph", f"{m}_graph_x_bf16_graph") for m in models if m != "bf16" and "bf16" in models]
    speed += [(f"{m} graph / eager", f"{m}_graph_x_{m}_eager") for m in models]
    head = "| batch | " + " | ".join(f"{m} {mode} ms" for m, mode in cols) + " | " + " | ".join(
        f"{label} (x)" for label, _ in speed) + " |"
    rows = [head, "|---:|" + "---:|" * (len(cols) + len(speed))]
    for b in results["batches"]:
        cells = [_fmt(results["models"][m]["batches"][str(b)][mode]["median_ms"], ".3f") for m, mode in cols]
        cells += [_fmt(results["derived"][str(b)].get(key), ".2f") for _, key in speed]
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def bandwidth_table(results: dict[str, Any]) -> str:
    """Markdown: the weight-read bandwidth of the graph steps (and its fraction of the copy bandwidth)."""
    models = _models(results)
    rows = ["| batch | " + " | ".join(f"{m} graph GB/s (of copy)" for m in models) + " |",
            "|---:|" + "---:|" * len(models)]
    for b in results["batches"]:
        d = results["derived"][str(b)]
        rows.append(f"| {b} | " + " | ".join(
            f"{_fmt(d.get(f'{m}_graph_weight_GBps'), '.0f')} ({_fmt(d.get(f'{m}_graph_weight_GBps_over_copy'), '.2f')})"
            for m in models) + " |")
    return "\n".join(rows)


def hbm_table(results: dict[str, Any]) -> str:
    """Markdown: bytes a step must read, the HBM-limited step time and measured / limit, per batch and model."""
    models = _models(results)
    rows = ["| batch | " + " | ".join(f"{m} GB read | {m} limit ms | {m} graph / limit | {m} eager / limit"
                                      for m in models) + " |",
            "|---:|" + "---:|" * (4 * len(models))]
    for b in results["batches"]:
        d = results["derived"][str(b)]
        cells = []
        for m in models:
            p = results["models"][m]["batches"][str(b)]
            nbytes = p.get("bytes_read")
            cells += [_fmt(nbytes / 1e9 if nbytes is not None else None, ".3f"), _fmt(p.get("hbm_limit_ms"), ".3f")]
            for mode in ("graph", "eager"):  # below 1: faster than the bytes allow, INVALID
                v = d.get(f"{m}_{mode}_over_hbm_limit")
                cells.append(mark(_fmt(v, ".2f"), hbm_limit_check(v, "time / HBM-limited time")))
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _class_batches(results: dict[str, Any], m: str) -> list[int]:
    return [b for b in results["batches"] if "table" in results["models"][m]["batches"][str(b)].get("classes", {})]


def class_tables(results: dict[str, Any]) -> str:
    """Markdown: one table per model, a row per kernel class (and the total), per profiled batch: kernels, the
    sum of their durations (ms), the MB the class must move, the time the HBM bandwidth allows for them
    (ms) and measured / allowed ("–" where not counted: every byte column of a MoE model); then the kernels per
    layer."""
    out = []
    for m in _models(results):
        batches = _class_batches(results, m)
        if not batches:
            continue
        head = "| class | " + " | ".join(f"b={b} n | b={b} ms | b={b} MB | b={b} allowed ms | b={b} x"
                                          for b in batches) + " |"
        rows = [f"### {m}", "", head, "|:---|" + "---:|" * (5 * len(batches))]
        for cls in CLASSES + ("total",):
            cells = []
            for b in batches:
                e = results["models"][m]["batches"][str(b)]["classes"]["table"][cls]
                mb = e["bytes"] / 1e6 if e["bytes"] is not None else None
                cells += [str(e["count"]), f"{e['ms']:.3f}", _num(mb), _num(e["allowed_ms"]), _num(e["ratio"])]
            label = f"**{cls}**" if cls == "total" else cls
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
        layers = results.get("config", {}).get("num_layers")
        if layers:  # issue 36's count (MoE: <= 6 kernels per MoE layer); the step's own few kernels included
            totals = {b: results["models"][m]["batches"][str(b)]["classes"]["table"]["total"] for b in batches}
            per = ", ".join(f"b={b}: {t['count'] / layers:.1f}" for b, t in totals.items())
            rows += ["", f"Kernels per layer (a step's kernels / {layers} layers): {per}."]
        out.append("\n".join(rows))
    return "\n\n".join(out) if out else "(no kernel profile)"


def kernel_tables(results: dict[str, Any]) -> str:
    """Markdown: per model, the kernels of the profiled PDL-off step by name (`_decoder_kernels.kernel_head`: a
    name without its template arguments, so every instantiation of one kernel is one row), those of the most time
    at any profiled batch: class, then per batch the count, the count per layer, the mean us per call and the sum
    (ms). Profiles of results written before the breakdown existed (no ``by_kernel``) are left out."""
    layers = results.get("config", {}).get("num_layers") or 1
    out = []
    for m in _models(results):
        profiles = {b: results["models"][m]["batches"][str(b)].get("classes", {}).get("profile", {})
                    for b in results["batches"]}
        profiles = {b: p["by_kernel"] for b, p in profiles.items() if p.get("by_kernel")}
        if not profiles:
            continue
        names = list(dict.fromkeys(n for p in profiles.values() for n in p))  # the first batch's order first
        head = "| kernel | class | " + " | ".join(f"b={b} n | b={b} per layer | b={b} us/call | b={b} ms"
                                                  for b in profiles) + " |"
        rows = [f"### {m}: kernels", "", head, "|:---|:---|" + "---:|" * (4 * len(profiles))]
        for name in names:
            cls = next(p[name]["class"] for p in profiles.values() if name in p)
            cells = []
            for p in profiles.values():
                e = p.get(name)
                cells += ([str(e["count"]), f"{e['count'] / layers:.2f}", f"{1e3 * e['ms'] / e['count']:.2f}",
                           f"{e['ms']:.3f}"] if e else ["–"] * 4)
            rows.append(f"| `{name}` | {cls} | " + " | ".join(cells) + " |")
        out.append("\n".join(rows))
    return "\n\n".join(out) if out else "(no per-kernel profile)"


def pdl_table(results: dict[str, Any]) -> str:
    """Markdown: graph step time with PDL off and on (interleaved, same run), on / off, and the profiled
    PDL-off step's kernel count and busy time (sum of durations; step - busy = the GPU's idle gaps)."""
    rows = ["| model | batch | graph PDL off ms | graph PDL on ms | on / off | kernels (PDL off) | busy ms "
            "| off step - busy ms |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in _models(results):
        for b in results["batches"]:
            p = results["models"][m]["batches"][str(b)]
            pdl = p.get("pdl")
            if not pdl:
                continue
            prof = p.get("classes", {}).get("profile", {})
            off = pdl["off"]["median_ms"]
            busy = prof.get("busy_ms")
            rows.append(f"| {m} | {b} | {off:.3f} | {pdl['on']['median_ms']:.3f} | {_fmt(pdl['on_over_off'], '.3f')} "
                        f"| {prof.get('kernels', '–')} | {_fmt(busy, '.3f')} "
                        f"| {_fmt(off - busy if busy is not None else None, '.3f')} |")
    return "\n".join(rows) if len(rows) > 2 else "(not measured)"


def capture_table(results: dict[str, Any]) -> str:
    rows = ["| model | lm_head | weights GiB | KV cache GiB | graphs | capture s | pool MiB | reserved +MiB "
            "| logits SQNR vs bf16 dB |",
            "|:---|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in _models(results):
        r = results["models"][m]
        c = r["capture"]
        sq = r.get("logits_vs_bf16", {}).get("sqnr_db")
        rows.append(f"| {m} | {r.get('lm_head', '?')} | {r['weight_bytes'] / 2**30:.2f} "
                    f"| {r['cache_bytes'] / 2**30:.2f} "
                    f"| {len(c['sizes'])} | {c['seconds']:.2f} | {_mib(c['pool_bytes'])} "
                    f"| {_mib(c['reserved_delta_bytes'])} | {_fmt(sq, '.1f')} |")
    return "\n".join(rows)


def targets_lines(results: dict[str, Any], issue: int = 18) -> list[str]:
    """Markdown bullets: each target of ``issue`` (an item's ``"issue"``, 18 when absent) with its value, bound and
    "met" / "NOT met" ("n/a" where not measured); issue 18's end with the ratio of weight bytes, bf16 / int8."""
    t = results["targets"]
    lines = []
    for item in t["items"]:
        if item.get("issue", 18) != issue:
            continue
        bound = "no target" if item["bound"] is None else f"target {item['sense']} {item['bound']}"
        detail = f"; {item['detail']}" if item["detail"] else ""
        lines.append(f"- {item['label']}: {_fmt(item['value'], '.3f')} ({bound}): "
                     f"{verdict(item['met'], item.get('invalid'))}{detail}")
    if issue == 18:
        lines.append("- ratio of weight bytes read per step, bf16 / int8: "
                     f"{_fmt(t['weight_bytes_bf16_over_int8'], '.2f')}x")
    return lines


def block_lines(results: dict[str, Any]) -> list[str]:
    """Markdown: the block-scaled fp8 model's graph step over the row-wise fp8 one per batch, and issue 26's target
    (empty without both models)."""
    keys = [(f"fp8-block{lmh}", f"fp8{lmh}") for lmh in ("", LMH)
            if f"fp8-block{lmh}" in results["models"] and f"fp8{lmh}" in results["models"]]
    if not keys:
        return []
    rows = ["| batch | " + " | ".join(f"{b} graph ms | {f} graph ms | {b} / {f}" for b, f in keys) + " |",
            "|---:|" + "---:|" * (3 * len(keys))]
    for batch in results["batches"]:
        cells = []
        for blk, fp8 in keys:
            cells += [_fmt(results["models"][m]["batches"][str(batch)]["graph"]["median_ms"], ".3f")
                      for m in (blk, fp8)]
            cells.append(_fmt(results["derived"][str(batch)].get(f"{blk}_graph_over_{fp8}_graph"), ".3f"))
        rows.append(f"| {batch} | " + " | ".join(cells) + " |")
    return ["", "## Block-scaled fp8 (issue 26)", "",
            "- fp8-block: every decoder projection a `W8A8Linear` with 128x128 weight blocks, activations quantized "
            "per 1x128 group (the fused norms and SiLU*mul with group_size = 128; o_proj quantizes attention's "
            "float output itself); the layers run the Python path (no one-op `decode_layer`). fp8: per-channel "
            "weights, per-token activations. Graph steps, bf16 lm_head unless +lmh.", "",
            "\n".join(rows), "", "### Targets (issue 26)", "", *targets_lines(results, 26)]


def _other_names(results: dict[str, Any]) -> list[str]:
    names: set[str] = set()
    for r in results["models"].values():
        for p in r.get("batches", {}).values():
            names.update(p.get("classes", {}).get("profile", {}).get("other_names", []))
    return sorted(names)[:OTHER_NAMES_MAX]


def render_markdown(results: dict[str, Any]) -> str:
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    c = results["config"]
    lmh = [m for m in _models(results) if m.endswith(LMH)]
    kv_read = next((m.get("kv_read") for m in results["models"].values() if m.get("kv_read")), "?")
    other = _other_names(results)
    lines = [
        f"# Decoder benchmark: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}",
        f"- {c['name']} dimensions, {c['num_layers']} layers: hidden {c['hidden_size']}, "
        + (f"MoE MLP: {c['num_experts']} experts of {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}, "
           "bf16 router, q/k head norms" if c.get("num_experts") else f"MLP {c['intermediate_size']}")
        + f", heads {c['num_heads']}/{c['num_kv_heads']} x {c['head_dim']}, vocab {c['vocab_size']}; random weights",
        f"- KV cache {results['max_seq']} tokens, sequences at position {results['max_seq'] // 2}; lm_head bf16 "
        f"in bf16/int8/fp8, W8A8 in {', '.join(lmh) if lmh else 'no model'} (\"+lmh\"); embedding bf16",
        f"- per-token latency = median of {results['timing']['steps']} steps timed by CUDA events around each "
        "step (host launches included), host inputs through pinned buffers",
        f"- device copy bandwidth {results['copy_GBps']:.0f} GB/s (bytes read + written)",
        "",
        "## Per-token latency",
        "",
        latency_table(results),
        "",
        "## Weight-read bandwidth of the graph steps",
        "",
        bandwidth_table(results),
        "",
        "## HBM-limited step time",
        "",
        f"- {results.get('hbm_note') or 'no HBM bandwidth recorded'}. Bytes read per step: every weight but the "
        f"embedding (lm_head included) + the KV cache the step's attention reads, {kv_read}, at the benchmark's "
        "positions, for the rows of the step's bucket, each byte once (1 GB = 1e9 B); limit = bytes / bandwidth; "
        "measured / limit >= 1.",
        "",
        hbm_table(results),
        "",
        "## Kernel classes of one graph step, PDL off (torch.profiler)",
        "",
        "- The graph recaptured with PDL off (`cutlass_w8a8.set_pdl(False)`): with PDL a kernel starts early and "
        "waits on griddepcontrol, and that wait would count in its duration. ms = sum of the class's kernel "
        "durations; allowed ms = the bytes the class must move / the datasheet HBM bandwidth; x = ms / allowed "
        "(latency-bound classes that move kilobytes show large ratios). Classes by kernel name "
        "(bench/_decoder_kernels.py KERNEL_RULES). Bytes per class:",
        *[f"  - {cls}: {note}" for cls, note in CLASS_BYTES_NOTES],
        f"- kernels classed \"other\": {', '.join(f'`{n}`' for n in other) if other else 'none'}",
        "",
        class_tables(results),
        "",
        "## Kernels of one graph step, PDL off (torch.profiler)",
        "",
        "- The same profiled steps by kernel name (template arguments dropped): the kernels of the most time "
        "(bench/_decoder_kernels.py KERNELS_MAX per step), per layer = count / the model's layers.",
        "",
        kernel_tables(results),
        "",
        "## PDL on / off (graph step, interleaved replays)",
        "",
        f"- Graphs captured with PDL on and with PDL off, replayed in turn; PDL "
        f"{'on' if results.get('pdl_default', True) else 'OFF (CUTLASS_W8A8_PDL=0)'} by default in this run "
        "(the latency table's graphs). on / off < 1: PDL saves time.",
        "",
        pdl_table(results),
        "",
        "## Capture, memory, accuracy",
        "",
        capture_table(results),
        "",
        "## Targets (issue 18)",
        "",
        *targets_lines(results),
        *block_lines(results),
    ]
    if any(item.get("issue") == 27 for item in results.get("targets", {}).get("items", [])):
        lines += ["", "## Qwen3-MoE decoder (issue 27)", "",
                  "- Bytes read per step count the non-expert weights and, per MoE layer, the experts that B tokens "
                  "with uniform random routing hit in expectation (E (1 - (1 - k/E)^B) of E).", "",
                  *targets_lines(results, 27)]
    failed = [f"- `{m}`: `{msg}`" for m, msg in results["errors"].items()]
    return markdown(lines, ("## Models that did not run", failed))


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: per-token latency against batch (one line per model and mode), and the speedups with targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax_lat, ax_x) = plt.subplots(1, 2, figsize=(13, 5))
    batches = results["batches"]
    for m in _models(results):
        r = results["models"][m]
        for mode, style in (("eager", "--"), ("graph", "-")):
            ys = [r["batches"][str(b)][mode]["median_ms"] for b in batches]
            ax_lat.plot(batches, ys, style, marker="o", markersize=4, label=f"{m} {mode}")
    ax_lat.set_ylabel("ms per step (= per token of each sequence)")
    ax_lat.set_title("Per-token decode latency")
    keys = [(f"{m}_graph_x_bf16_graph", f"{m} graph / bf16 graph") for m in _models(results) if m != "bf16"]
    keys += [("int8_graph_x_int8_eager", "int8 graph / int8 eager"),
             ("bf16_graph_x_bf16_eager", "bf16 graph / bf16 eager")]
    for key, label in keys:
        xy = [(b, results["derived"][str(b)].get(key)) for b in batches]
        xy = [(b, y) for b, y in xy if y is not None]
        if xy:
            ax_x.plot(*zip(*xy), marker="o", markersize=4, label=label)
    for y, label in ((TARGET_INT8_OVER_BF16, "target int8/bf16 (batch 1)"),
                     (TARGET_GRAPH_OVER_EAGER, "target graph/eager (batch 1)")):
        ax_x.axhline(y, color="gray", linestyle=":", linewidth=1)
        ax_x.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8, color="gray")
    ax_x.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_x.set_ylabel("speedup (x)")
    ax_x.set_title("Speedups")
    for ax in (ax_lat, ax_x):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("batch (sequences)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    c = results["config"]
    save_figure(fig, path,
                f"{c['name']} x {c['num_layers']} layers, {results['device']}, torch {results['torch_version']}")
